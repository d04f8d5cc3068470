"""HQQ onto MatMulNBits (engines/onnxruntime_genai/hqq.py) on the builder's fp32 decoder of a tiny
Llama: every body MatMul at 4 bits, the LM head at 8, nothing left at full precision; the model still
scores like the fp32 one and generates; the engine method refuses settings HQQ does not take."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from optimize.errors import RecipeError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="needs onnxruntime-genai")


@pytest.fixture(scope="module")
def fp32_decoder(tmp_path_factory) -> Path:
    from engines.onnxruntime_genai.build import build
    from tests.support.models import tiny_llama_folder

    work = tmp_path_factory.mktemp("hqq")
    source = tiny_llama_folder(work / "src", max_positions=256, hidden=256, ffn=256)
    build(source, work / "fp32", "fp32", "cpu", [], work / "cache")
    return work / "fp32"


@pytest.mark.slow
def test_hqq_puts_the_body_at_4_bits_and_the_head_at_8_and_scores_like_fp32(fp32_decoder, tmp_path):
    import onnx

    from engines.onnxruntime_genai.build import weight_precision
    from engines.onnxruntime_genai.hqq import quantize_hqq
    from engines.onnxruntime_genai.runner import GenAIRunner

    folder = tmp_path / "hqq"
    shutil.copytree(fp32_decoder, folder)
    counts = quantize_hqq(folder, block_size=32, head_bits=8, accuracy_level=1)
    assert counts == {8: 1, 4: 2 * 5}  # the head, then 5 MatMuls in each of 2 layers (Q, K and V fused)
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert not [
        n.name for n in graph.node if n.op_type == "MatMul" and any(i.name == n.input[1] for i in graph.initializer)
    ]
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"
    }
    assert {b for name, b in bits.items() if "lm_head" in name} == {8}
    assert {b for name, b in bits.items() if "lm_head" not in name} == {4}
    assert "int4" in weight_precision(folder / "model.onnx")
    ids = GenAIRunner(fp32_decoder, threads=1).encode("The return statement leaves the current function call." * 3)
    full, hqq = (GenAIRunner(d, threads=1).log_likelihood(ids) for d in (fp32_decoder, folder))
    assert np.isfinite(hqq).all() and not np.array_equal(full, hqq)
    assert abs(hqq.mean() - full.mean()) < 0.05 * abs(full.mean())  # a random tiny model: close, not equal


def test_the_engine_method_refuses_what_hqq_does_not_take():
    from optimize.compile.onnxruntime_genai import GenAIConfig

    GenAIConfig(algo_config="hqq").validate()
    for bad in ({"precision": "int8"}, {"matmul_mixed_precision": "last_matmul:int8"}, {"nodes_to_exclude": ["x"]}):
        with pytest.raises(RecipeError, match="hqq"):
            GenAIConfig(algo_config="hqq", **bad).validate()


def test_settings_the_quantizer_cannot_take_are_one_line(tmp_path):
    from engines.onnxruntime_genai.hqq import HQQError, quantize_hqq

    with pytest.raises(HQQError, match="head_bits 2"):
        quantize_hqq(tmp_path, head_bits=2)
