"""The GGUF writer (optimize/export/gguf): files of every type written from a tiny Llama and read
back (tokenizer, chat template, each tensor's type by llama.cpp's rules, each type's weights within its
rounding, the logits transformers computes from the file), the importance matrix's effect, the
Modelfile, and one-line refusals of a type or model the writer cannot write."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "libgguf", "jinja2", "transformers")),
    reason="needs gguf, libgguf, jinja2 and transformers (pip install 'optimize[llm]')",
)
ROOT = Path(__file__).resolve().parents[2]
# Relative RMS error of a tensor of normal values rounded to each type (measured about a third of it).
RMS_BOUND = {"F32": 0.0, "F16": 1e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.06, "Q5_0": 0.08, "Q5_1": 0.08}
RMS_BOUND.update({"Q4_K": 0.12, "Q4_0": 0.15, "Q4_1": 0.15})
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, module): 8 layers of width 256 (whole K-quant super-blocks), ffn 512."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.models import tiny_llama_folder

    folder = tiny_llama_folder(tmp_path_factory.mktemp("tiny") / "hf", hidden=256, ffn=512, layers=8)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    from optimize.export.gguf import FILE_TYPES, writer

    folder, module = tiny
    out = tmp_path_factory.mktemp("gguf")
    return {t: writer.write(module, out / f"{t}.gguf", t, tokenizer_dir=folder) for t in FILE_TYPES}


def fields(path: Path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def test_every_type_reads_back_with_its_tokenizer_template_and_hyperparameters(tiny, written):
    folder, module = tiny
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    template = (
        json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        or (folder / "chat_template.jinja").read_text()
    )
    for kind, done in written.items():
        meta, _ = fields(done.path)
        assert meta["general.architecture"] == "llama"
        assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
        assert meta["tokenizer.ggml.tokens"][: len(vocab)] == [t for t, _ in vocab], kind
        assert len(meta["tokenizer.ggml.merges"]) == len(spec["model"]["merges"])
        assert meta["tokenizer.chat_template"] == template
        assert meta["llama.block_count"] == 8 and meta["llama.embedding_length"] == 256
        assert meta["llama.attention.head_count_kv"] == 2 and meta["llama.vocab_size"] == module.config.vocab_size


def test_each_tensor_has_llama_cpps_type_and_its_weights_within_the_types_rounding(tiny, written):
    import gguf

    from optimize.export.gguf import mixes, writer

    _, module = tiny
    stored = writer.gguf_tensors(module, module.config, "llama")
    for kind, done in written.items():
        _, tensors = fields(done.path)
        assert set(tensors) == set(stored)
        expected = mixes.tensor_types(kind, {n: a.shape for n, a in stored.items()}, 8)
        for name, t in tensors.items():
            assert t.tensor_type.name == expected[name] == done.types[name], (kind, name)
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(stored[name].shape)
            error = np.sqrt(np.mean((values - stored[name]) ** 2) / np.mean(stored[name] ** 2))
            assert error <= RMS_BOUND[t.tensor_type.name], (kind, name, t.tensor_type.name, error)


def test_the_mixes_follow_llama_cpp(tiny, written):
    types = written["Q4_K_M"].types
    more = [i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more == [0, 3, 6, 7]  # the first and last eighth, and every third layer between
    assert [i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == more
    assert types["blk.1.attn_q.weight"] == "Q4_K" and types["token_embd.weight"] == "Q6_K"  # tied: the output's
    assert written["Q5_K_M"].types["blk.1.ffn_up.weight"] == "Q5_K"
    assert written["Q4_0"].types["token_embd.weight"] == "Q6_K"
    assert set(written["Q8_0"].summary()) == {"Q8_0", "F32"}


def test_rows_a_k_quant_block_does_not_divide_fall_back_as_llama_cpp_does():
    from optimize.export.gguf import mixes

    shapes: dict[str, tuple] = {
        "token_embd.weight": (49152, 576),
        "blk.0.attn_q.weight": (576, 576),
        "blk.0.ffn_down.weight": (576, 1536),
    }
    shapes["blk.0.attn_norm.weight"] = (576,)
    assert mixes.tensor_types("Q4_K_M", shapes, 30) == {
        "token_embd.weight": "Q8_0",  # tied output of 576 columns: Q8_0
        "blk.0.attn_q.weight": "Q5_0",  # Q4_K -> Q5_0
        "blk.0.ffn_down.weight": "Q6_K",  # 1536 columns: whole super-blocks, layer 0 uses more bits
        "blk.0.attn_norm.weight": "F32",
    }
    assert mixes.fallback("Q5_K", 576) == "Q5_1" and mixes.fallback("Q6_K", 576) == "Q8_0"
    assert mixes.fallback("Q4_0", 40) == "F16"


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
def test_transformers_reads_each_file_to_the_same_logits_as_its_dequantized_weights(tiny, written):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    _, module = tiny
    ids = torch.tensor([[5, 17, 42, 99, 7, 256, 300, 11]])
    with torch.inference_mode():
        reference = module(ids).logits
        for kind, done in written.items():
            loaded = AutoModelForCausalLM.from_pretrained(
                str(done.path.parent), gguf_file=done.path.name, dtype=torch.float32
            ).eval()
            # The file's weights, un-permuted by hand, in a copy of the source model: the same logits.
            _, tensors = fields(done.path)
            mine = type(module)(module.config).eval()
            mine.load_state_dict(module.state_dict())
            for name, t in tensors.items():
                values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
                target = hf_parameter(mine, name)
                target.data = torch.from_numpy(unpermuted(values, name, module.config)).reshape(target.shape)
            got = loaded(ids).logits
            assert torch.allclose(got, mine(ids).logits, atol=1e-4), kind
            spread = float(reference.std())
            assert float((got - reference).abs().max()) < {"Q8_0": 0.05, "Q6_K": 0.1}.get(kind, 0.6) * spread * 10


def hf_parameter(model, gguf_name: str):
    names = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        path = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
    else:
        path = f"{names[parts[0]]}.weight"
    return model.get_parameter(path)


def unpermuted(values: np.ndarray, name: str, config) -> np.ndarray:
    """llama.cpp's interleaved rotary rows back to Hugging Face's halves."""
    if not name.endswith(("attn_q.weight", "attn_k.weight")):
        return values
    heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
    rows = values.reshape(-1, config.hidden_size)
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def test_the_tokenizer_round_trips_through_the_file(tiny, written):
    from transformers import AutoTokenizer

    folder, _ = tiny
    done = written["Q8_0"]
    source = AutoTokenizer.from_pretrained(folder)
    read = AutoTokenizer.from_pretrained(str(done.path.parent), gguf_file=done.path.name)
    text = "The interpreter reads a module's __init__.py first, then 42 names.\n  Indented."
    assert read(text)["input_ids"] == source(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert read.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(chat, tokenize=False)


def test_a_gguf_source_s_tokenizer_keys_are_copied_exactly(tiny, written, tmp_path):
    from optimize.export.gguf import writer

    _, module = tiny
    first = written["Q8_0"].path
    again = writer.write(module, tmp_path / "again.gguf", "Q4_0", tokenizer_gguf=first).path
    a, b = fields(first)[0], fields(again)[0]
    assert {k: v for k, v in a.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in b.items() if k.startswith("tokenizer.")
    }


def test_the_importance_matrix_weighs_the_rounding(tiny, tmp_path):
    import torch

    from optimize.export.gguf import imatrix, quant, writer

    folder, module = tiny
    rng = np.random.default_rng(0)
    sequences = [list(rng.integers(1, 500, size=64)) for _ in range(4)]
    means = imatrix.collect(module, sequences)
    stored = writer.gguf_tensors(module, module.config, "llama")
    assert set(means) == {n for n in stored if n.endswith(".weight") and "norm" not in n}  # tied head: token_embd
    assert all(means[n].shape == (stored[n].shape[-1],) and (means[n] >= 0).all() for n in means)
    name = "blk.2.ffn_up.weight"
    w, weights = stored[name], means[name] * np.linspace(0.01, 100, means[name].size).astype(np.float32)
    import gguf

    def weighted_error(imat):
        packed, qtype = quant.encode(w, "Q4_K", imat)
        back = gguf.quants.dequantize(packed, qtype).reshape(w.shape)
        return float((((back - w) ** 2) * weights).sum())

    assert weighted_error(weights) < 0.97 * weighted_error(None)  # measured 0.93
    with_matrix = writer.write(module, tmp_path / "i.gguf", "Q4_K_M", tokenizer_dir=folder, imatrix=means)
    assert with_matrix.imatrix
    imatrix.save_gguf(tmp_path / "imatrix.gguf", means, "test", 4, 64)
    meta, tensors = fields(tmp_path / "imatrix.gguf")
    assert meta["imatrix.chunk_count"] == 4 and f"{name}.in_sum2" in tensors
    del torch


def test_the_numpy_and_c_quantizers_agree_byte_for_byte_on_the_32_value_types():
    import gguf
    import libgguf

    rows = np.random.default_rng(1).normal(size=(8, 256)).astype(np.float32)
    rows[0, :32] = 0  # an all-zero block
    for kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        numpy_bytes = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[kind])
        c_bytes = libgguf.quantize_rows(rows, libgguf.GGMLQuantizationType[kind])
        assert np.array_equal(numpy_bytes, c_bytes), kind
    # Q8_0 by hand: each block of 32 an f16 scale amax / 127 and the values divided by it, rounded.
    block = rows[1, :32]
    scale = np.abs(block).max() / 127
    q8 = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
    assert q8[1, :2].view(np.float16)[0] == np.float16(scale)
    assert np.array_equal(q8[1, 2:34].view(np.int8), np.round(block / scale).astype(np.int8))


def test_the_modelfile_says_from_template_and_stop(written, tmp_path):
    from optimize.export.gguf import modelfile

    text = modelfile.modelfile("model.gguf", CHATML, ["<|im_end|>", "<|im_end|>"])
    assert text.startswith("FROM ./model.gguf\n")
    assert 'TEMPLATE """{{- if or (not .Messages) (ne (index .Messages 0).Role "system") }}<|im_start|>system\n' in text
    assert "trained by Hugging Face<|im_end|>\n{{ end }}" in text
    assert (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
        in text
    )
    assert text.count('PARAMETER stop "<|im_end|>"') == 1
    # A template that is not ChatML: no TEMPLATE (Ollama reads the file's own), the EOS token a stop.
    own = modelfile.for_gguf(written["Q8_0"].path)
    assert own.startswith("FROM ./Q8_0.gguf\n") and "TEMPLATE" not in own
    assert 'PARAMETER stop "<|endoftext|>"' in own


def test_a_type_or_model_the_writer_cannot_write_is_refused_in_one_line(tiny, tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from optimize.export.gguf import ExportError, writer

    folder, module = tiny
    with pytest.raises(ExportError, match="GGUF type 'Q3_K' cannot be written"):
        writer.write(module, tmp_path / "x.gguf", "Q3_K", tokenizer_dir=folder)
    bert = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ExportError, match="model type 'bert': the GGUF writer writes llama, qwen2"):
        writer.write(bert, tmp_path / "x.gguf", "Q8_0", tokenizer_dir=folder)
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
def test_the_command_line_refuses_in_one_line_and_writes_a_file_and_modelfile(tiny, tmp_path):
    folder, _ = tiny
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "optimize.export.gguf", str(folder), str(tmp_path / "m.gguf")]
    bad = subprocess.run([*command, "--type", "IQ2_XS"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: GGUF type 'IQ2_XS' cannot be written (written: Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0)"
    ]
    assert not list(tmp_path.iterdir())
    good = subprocess.run([*command, "--type", "Q4_0"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert good.returncode == 0, good.stderr[-2000:]
    assert (tmp_path / "Modelfile").read_text().startswith("FROM ./m.gguf\n")


@pytest.mark.skipif(not os.environ.get("PEERS_LLAMA_SERVER"), reason="no llama-server ($PEERS_LLAMA_SERVER unset)")
def test_llama_server_loads_the_file_and_answers_a_chat_completion(written, tmp_path):
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = written["Q4_K_M"].path
    server = subprocess.Popen(
        [os.environ["PEERS_LLAMA_SERVER"], "-m", str(path), "--port", str(port), "-t", "2", "-c", "512"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}).encode()
        deadline, answer = time.time() + 120, None
        while time.time() < deadline and answer is None:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
                )
                answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
            except OSError:
                assert server.poll() is None, "llama-server exited"
                time.sleep(1)
        assert answer is not None and answer["choices"][0]["message"]["role"] == "assistant"
    finally:
        server.terminate()
        server.wait(timeout=30)
