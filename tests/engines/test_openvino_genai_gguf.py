"""A GGUF file carried through as it is (engines/openvino/genai_gguf.py): OpenVINO GenAI's GGUF reader
on files the tests write (a tiny random Llama of width 256, so every matrix fills K-quant
super-blocks), its rounded constants made exact, scored against the file dequantized by transformers
(the pipeline's baseline): equal within f32 numerics for every carried type and for a file mixing
them; a type the reader does not read, and a malformed file, are refused in one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "openvino", "openvino_genai", "openvino_tokenizers")),
    reason="needs gguf, openvino, openvino-genai and openvino-tokenizers",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A 2-layer width-256 random Llama (4 query / 2 key-value heads) with the suite's BPE tokenizer."""
    from tests.support.models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("wide_llama"), max_positions=256, hidden=256, ffn=256)


def mixed(name: str) -> str:
    """Types mixed as llama.cpp's Q4_K_M mixes them (and more): each matrix kind its own."""
    for part, kind in (
        ("attn_q", "Q4_1"),
        ("attn_k", "Q4_0"),
        ("attn_v", "Q6_K"),
        ("ffn_down", "Q6_K"),
        ("token_embd", "Q8_0"),
    ):
        if part in name:
            return kind
    return "Q4_K"


def _carried(folder: Path, tmp_path: Path, qtype):
    """(log-likelihoods of the carried IR, of the dequantized model, the patch counts)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.openvino import genai_gguf
    from engines.openvino.genai_build import convert_tokenizer, copy_configs
    from engines.openvino.genai_runner import OVGenAIRunner
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", qtype)
    architecture, tensors = genai_gguf.tensors(path)
    assert genai_gguf.uncarried(architecture, tensors) is None
    out = tmp_path / "ov"
    patched, fused = genai_gguf.build_from_gguf(path, out)
    assert fused["groups"] == 2 * 2 and fused["fused"] >= 2  # q, k, v and gate, up of 2 layers, alike where fused
    convert_tokenizer(folder, out)
    copy_configs(folder, out)
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 500, 48)]
    runner = OVGenAIRunner(out, inference_precision="f32", kv_cache_precision="f32")
    dequantized = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    with torch.no_grad():
        logits = dequantized(torch.tensor([ids])).logits[0].double()
    reference = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    return np.asarray(runner.log_likelihood(ids)), reference, patched, tensors


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "mixed"])
def test_a_carried_gguf_computes_what_the_dequantized_file_does(folder, tmp_path, qtype):
    """Per-token log-likelihoods of the carried IR against the dequantized file: equal to f32 rounding.
    (The reader's own IR rounds Q4_1's and Q4_K's zero points to integers: on SmolLM2's Q4_1 file its
    logits were up to 14.7 off the dequantized model's, against 1e-4 here.)"""
    ours, reference, patched, tensors = _carried(folder, tmp_path, mixed if qtype == "mixed" else qtype)
    np.testing.assert_allclose(ours, reference, atol=2e-3)
    types = {t.type for t in tensors if len(t.shape) >= 2}
    assert set(patched) == types & {"Q4_1", "Q4_K", "Q6_K"}
    if qtype == "mixed":
        assert types == {"Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"}


def test_a_type_the_reader_does_not_read_is_named(folder, tmp_path):
    """Q5_0 (a legacy type llama.cpp still writes) is not one OpenVINO GenAI's reader reads: the
    tensors are named before anything is built."""
    from engines.openvino import genai_gguf
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", lambda name: "Q5_0" if "ffn_up" in name else "Q8_0")
    reason = genai_gguf.uncarried(*genai_gguf.tensors(path))
    assert reason == (
        "OpenVINO GenAI's GGUF reader does not read these tensors' types: "
        "blk.0.ffn_up.weight (Q5_0), blk.1.ffn_up.weight (Q5_0)"
    )
    summary = genai_gguf.type_summary(genai_gguf.tensors(path)[1])
    assert summary["Q5_0"]["count"] == 2 and summary["Q8_0"]["became"].startswith("u8, block 32")


def test_a_tensor_whose_bytes_are_not_whole_blocks_is_refused(folder, tmp_path):
    """A GGUF whose block count does not match its shape (a Q8_0 row of 48 values, not whole blocks
    of 32), and one of a tensor type no reader knows: one line each, nothing built."""
    import gguf

    from engines.openvino import genai_gguf

    path = tmp_path / "good.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    packed = gguf.quants.quantize(np.ones((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    at = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")  # then n_dims, the dims, the type

    def edited(name: str, offset: int, value: int, size: int) -> Path:
        out = bytearray(data)
        out[at + offset : at + offset + size] = value.to_bytes(size, "little")
        (tmp_path / name).write_bytes(bytes(out))
        return tmp_path / name

    with pytest.raises(
        genai_gguf.CarryError, match=r"^short.gguf is not a GGUF file the readers know \(.*row size \(48\).*Q8_0"
    ):
        genai_gguf.tensors(edited("short.gguf", 4, 48, 8))  # rows of 48 values: 1.5 blocks each
    with pytest.raises(genai_gguf.CarryError, match=r"^unknown.gguf is not a GGUF file the readers know"):
        genai_gguf.tensors(edited("unknown.gguf", 4 + 2 * 8, 200, 4))  # tensor type 200
