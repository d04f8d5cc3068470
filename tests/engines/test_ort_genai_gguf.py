"""A GGUF file's blocks carried into ONNX Runtime GenAI's MatMulNBits weights
(engines/onnxruntime_genai/gguf.py): the builder's decoder from the file dequantized, its layer
weights then the file's Q4_0 / Q4_1 / Q8_0 blocks, scored against the file dequantized by
transformers (the pipeline's baseline): equal within f32 numerics for each type and for a file mixing
them; a fused matrix of two bit widths and a type with no exact form are refused, naming the tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "onnxruntime_genai")),
    reason="needs gguf and onnxruntime-genai",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from tests.support.models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("llama"))


def mixed(name: str) -> str:
    """Each matrix kind its own type; Q and K (fused with V into one qkv_proj) of two 4-bit types."""
    for part, kind in (("attn_q", "Q4_1"), ("attn_k", "Q4_0"), ("ffn_down", "Q8_0"), ("token_embd", "Q8_0")):
        if part in name:
            return kind
    return "Q4_1"


def _build(folder: Path, tmp_path: Path, qtype, accuracy_level: int = 1):
    """(the GGUF path, the carried model's folder, the carried counts, the file dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.onnxruntime_genai import gguf as carry
    from engines.onnxruntime_genai.build import build
    from optimize.models import save_converted
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", qtype)
    dequantized = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    save_converted(dequantized, tmp_path, "model.gguf", tmp_path / "dequantized", "test")
    out = tmp_path / "ort" / "genai"
    options = ["block_size=32", f"accuracy_level={accuracy_level}", *carry.BUILDER_OPTIONS]
    build(tmp_path / "dequantized", out, "int4", "cpu", options, tmp_path / "cache")
    carried = carry.carry_blocks(path, out / "model.onnx", accuracy_level)
    return path, out, carried, dequantized


def _assert_equal_to_the_dequantized_file(out: Path, dequantized) -> None:
    """Per-token log-likelihoods of the carried model against the dequantized file: equal to f32
    rounding (1e-6 seen)."""
    import torch

    from engines.onnxruntime_genai.runner import GenAIRunner

    ids = [int(i) for i in np.random.default_rng(0).integers(1, 500, 48)]
    ours = np.asarray(GenAIRunner(out).log_likelihood(ids))
    with torch.no_grad():
        logits = dequantized(torch.tensor([ids])).logits[0].double()
    reference = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "mixed"])
def test_carried_blocks_compute_what_the_dequantized_file_does(folder, tmp_path, qtype):
    """Equal to the dequantized file; every layer matrix carried, the embedding f32, the (tied) LM head
    the file's blocks where they are 4-bit (Q4_0, Q4_1), f32 where Q8_0 (mixed: token_embd Q8_0)."""
    from engines.onnxruntime_genai.build import weight_precision

    _, out, carried, dequantized = _build(folder, tmp_path, mixed if qtype == "mixed" else qtype)
    _assert_equal_to_the_dequantized_file(out, dequantized)
    head_carried = qtype in ("Q4_0", "Q4_1")
    assert sum(carried.values()) == 2 * 7 + head_carried  # 2 layers of q, k, v, o, gate, up, down
    if qtype == "mixed":
        assert carried == {"Q4_1": 10, "Q4_0": 2, "Q8_0": 2}  # q, v, o, gate, up; k; down
    else:
        assert carried == {qtype: 14 + head_carried}
    layers = weight_precision(out / "model.onnx")
    assert layers["float"]["nodes"] == ["embed_tokens/Gather"] + ([] if head_carried else ["lm_head"]), layers
    assert layers["int4" if qtype != "Q8_0" else "int8"]["count"] == 10 - (2 if qtype == "mixed" else 0) + head_carried


@pytest.mark.slow
def test_a_qwen2_file_is_carried_too(tmp_path):
    """Qwen2 (biases on Q, K and V, rows not permuted by llama.cpp): equal to the dequantized file."""
    from tests.support.tiny_archs import tiny_folder

    _, out, carried, dequantized = _build(tiny_folder("qwen2", tmp_path / "hf"), tmp_path, "Q4_1")
    _assert_equal_to_the_dequantized_file(out, dequantized)
    assert carried == {"Q4_1": 15}  # the tied LM head too


@pytest.mark.slow
def test_a_fused_matrix_of_two_bit_widths_is_refused(folder, tmp_path):
    """V at 8 bits beside Q and K at 4: the builder's one qkv_proj cannot hold both; named."""
    from engines.openvino.genai_gguf import CarryError

    with pytest.raises(
        CarryError, match=r"qkv_proj/MatMul_Q4 fuses blk\.0\.attn_q\.weight \(Q4_0\).*attn_v\.weight \(Q8_0\)"
    ):
        _build(folder, tmp_path, lambda name: "Q8_0" if "attn_v" in name else "Q4_0")


def test_a_type_with_no_exact_form_is_named(folder, tmp_path):
    """Q5_0 layer matrices are named before anything is built; a Q5_0 embedding would not be (it stays f32)."""
    from engines.onnxruntime_genai import gguf as carry
    from engines.openvino import genai_gguf
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", lambda name: "Q5_0" if "ffn_up" in name else "Q8_0")
    architecture, tensors = genai_gguf.tensors(path)
    assert carry.uncarried(architecture, tensors) == (
        "MatMulNBits has no exact form of these tensors' types: blk.0.ffn_up.weight (Q5_0), blk.1.ffn_up.weight (Q5_0)"
    )
    became = carry.became(tensors, 1)
    assert became["Q8_0"].startswith("MatMulNBits bits 8") and became["Q8_0"].endswith(
        "token_embd.weight: f32, dequantized from the file by the builder (the file's values, not its blocks)"
    )
    assert carry.uncarried(architecture, [t for t in tensors if t.type != "Q5_0"]) is None


@pytest.mark.slow
def test_a_q8_0_lm_head_is_carried_with_int8_activations(folder, tmp_path):
    """Q8_0 embedding at accuracy_level 4: the LM head 8-bit blocks (the CPU's fast 8-bit path); at
    accuracy_level 1 it stays f32 (the other tests)."""
    from engines.onnxruntime_genai.build import weight_precision
    from engines.onnxruntime_genai.runner import GenAIRunner

    _, out, carried, _ = _build(folder, tmp_path, lambda name: "Q8_0" if "token_embd" in name else "Q4_0", 4)
    assert carried == {"Q4_0": 14, "Q8_0": 1}
    assert weight_precision(out / "model.onnx")["int8"]["nodes"] == ["lm_head"]
    assert np.isfinite(GenAIRunner(out).log_likelihood(list(range(1, 20)))).all()
