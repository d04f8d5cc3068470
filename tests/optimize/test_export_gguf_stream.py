"""The streamed GGUF writer (optimize/export/gguf/writer.py) against the writer it replaced: the same
bytes for every file type, with and without an importance matrix, from a bf16 or FP32 module, tied
(Llama) or untied (Qwen2), with tensors cut into many row blocks; and it never holds the model's
quantized tensors (or their FP32 conversion) all at once, as the replaced writer did."""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "libgguf", "jinja2", "transformers")),
    reason="needs gguf, libgguf, jinja2 and transformers (pip install 'optimize[llm]')",
)


def written_whole(module, out: Path, file_type: str, tokenizer_dir: Path, imatrix: dict | None = None) -> Path:
    """The replaced writer's way, kept as the reference: every tensor converted to FP32 and quantized
    first, all held by GGUFWriter.add_tensor, then written by write_tensors_to_file."""
    import gguf

    from optimize.export.gguf import mixes, quant, vocab
    from optimize.export.gguf.writer import architecture_of, as_stored, write_header

    config = module.config
    arch = architecture_of(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tensors = {}
    for hf_name, tensor in module.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(base)
        tensors[f"{mapped}.{suffix}"] = as_stored(tensor.detach().float().numpy(), mapped, config, arch)
    types = mixes.tensor_types(
        file_type, {k: v.shape for k, v in tensors.items()}, config.num_hidden_layers, bool(imatrix)
    )
    writer = gguf.GGUFWriter(str(out), arch)
    write_header(writer, config, file_type, None)
    vocab.write_from_folder(writer, tokenizer_dir, config)
    for name, data in tensors.items():
        weights = (imatrix or {}).get(name) if types[name] != "F32" else None
        stored, raw = quant.encode(data, types[name], weights)
        writer.add_tensor(name, stored, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, FP32 Llama, its bf16 copy, an untied FP32 Qwen2 of the same vocabulary, the Llama's imatrix)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from optimize.export.gguf import imatrix
    from tests.support.models import tiny_llama_folder

    folder = tiny_llama_folder(tmp_path_factory.mktemp("tiny") / "hf", hidden=256, ffn=512, layers=8)
    llama = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=llama.config.vocab_size,
            tie_word_embeddings=False,
            max_position_embeddings=512,
        )
    ).eval()
    rng = np.random.default_rng(0)
    means = imatrix.collect(llama, [list(rng.integers(1, 500, size=64)) for _ in range(2)])
    return folder, llama, bf16, qwen, means


@pytest.mark.parametrize("file_type", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0"])
def test_the_streamed_file_is_the_replaced_writers_byte_for_byte(tiny, tmp_path, monkeypatch, file_type):
    from optimize.export.gguf import writer

    folder, llama, bf16, qwen, means = tiny
    # Blocks of 3 rows of 256 values (the embedding's 512 rows end in a partial block): the rows are
    # rounded block by block, and the bytes must not show it.
    monkeypatch.setattr(writer, "BLOCK_VALUES", 3 * 256)
    weighted = None if file_type == "Q8_0" else means  # Q8_0 takes no importance matrix (gguf_export.py)
    for label, module, weights in (("llama", llama, weighted), ("bf16", bf16, None), ("qwen2", qwen, None)):
        streamed = writer.write(module, tmp_path / f"{label}.gguf", file_type, tokenizer_dir=folder, imatrix=weights)
        whole = written_whole(module, tmp_path / f"{label}.whole.gguf", file_type, folder, weights)
        assert streamed.path.read_bytes() == whole.read_bytes(), (file_type, label)
    assert not list(tmp_path.glob("*.partial"))


def test_the_streamed_writer_holds_one_tensor_not_the_model(tiny, tmp_path):
    """Traced (numpy) bytes at the peak of each write: the replaced writer held every quantized tensor
    until the end; the streamed one holds one tensor's block at a time."""
    from optimize.export.gguf import writer

    folder, llama, _, _, _ = tiny
    file_bytes = {}

    def peak(write) -> int:
        tracemalloc.start()
        try:
            file_bytes[write.__name__] = write().stat().st_size
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def streamed() -> Path:
        return writer.write(llama, tmp_path / "s.gguf", "Q8_0", tokenizer_dir=folder).path

    def whole() -> Path:
        return written_whole(llama, tmp_path / "w.gguf", "Q8_0", folder)

    held_whole, held_streamed = peak(whole), peak(streamed)
    largest = max(p.numel() for p in llama.parameters()) * 4  # one tensor in FP32
    assert held_whole > file_bytes["whole"]  # the replaced writer: the whole file's tensors at once
    assert held_streamed < file_bytes["streamed"] / 4 and held_streamed < 4 * largest


def test_a_write_that_fails_midway_leaves_nothing(tiny, tmp_path):
    from optimize.export.gguf import ExportError, writer

    folder, llama, _, _, means = tiny
    bad = dict(means)
    bad["blk.5.ffn_up.weight"] = np.ones(3, dtype=np.float32)  # refused while the tensors are being written
    with pytest.raises(ExportError, match="importance matrix"):
        writer.write(llama, tmp_path / "x.gguf", "Q4_K_M", tokenizer_dir=folder, imatrix=bad)
    assert not list(tmp_path.iterdir())


def test_the_command_line_writes_a_bf16_folder_as_its_fp32_load_would(tiny, tmp_path):
    """The command line keeps a bf16 folder memory-mapped in bf16 and collects the importance matrix a
    module at a time in FP32: the file is the one written from the folder loaded in FP32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimize.export.gguf import __main__ as cli
    from optimize.export.gguf import imatrix, writer

    folder, _, bf16, _, _ = tiny
    half = tmp_path / "bf16"
    bf16.save_pretrained(half)
    AutoTokenizer.from_pretrained(folder).save_pretrained(half)
    text = tmp_path / "calibration.txt"
    text.write_text("def f(x):\n    return x + 1\n\nThe quick brown fox jumps over the lazy dog.\n", encoding="utf-8")
    args = ["--type", "Q4_K_M", "--calibration-text", str(text), "--calibration-tokens", "32"]
    assert cli.main([str(half), str(tmp_path / "cli.gguf"), *args]) == 0
    upcast = AutoModelForCausalLM.from_pretrained(half, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(half)
    means = imatrix.collect(upcast, cli.calibration_sequences(text, tokenizer, 32))
    reference = writer.write(upcast, tmp_path / "fp32.gguf", "Q4_K_M", tokenizer_dir=half, imatrix=means)
    assert (tmp_path / "cli.gguf").read_bytes() == reference.path.read_bytes()
