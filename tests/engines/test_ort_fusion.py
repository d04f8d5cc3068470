"""Fusion into ONNX Runtime's kernels, and packing the fused Attention's QKV so it can be quantized."""

import numpy as np
import pytest

from engines.onnxruntime.export import export
from engines.onnxruntime.fusion import fuse_for_onnxruntime, pack_attention_qkv
from engines.onnxruntime.runner import OrtRunner
from engines.pytorch.runner import sentence_embedding_module
from optimize.quantize.common import int8_node_counts
from tests.support.models import encode, tiny_bert


@pytest.fixture(scope="module")
def fused_bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused")
    module = sentence_embedding_module(tiny_bert(layers=2), {"mode": "mean", "normalize": False})
    inputs = encode(["a text", "another text"])
    axes = {n: {0: "batch", 1: "sequence"} for n in inputs}
    path = export(module, inputs, ["last_hidden_state", "sentence_embedding"], folder / "model.onnx", axes)
    assert fuse_for_onnxruntime(path).get("attention") == 2
    return path


@pytest.mark.slow
def test_packed_attention_computes_the_same_and_quantizes_to_qattention(fused_bert, tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    packed, count = pack_attention_qkv(fused_bert, tmp_path / "packed.onnx")
    assert count == 2
    inputs = encode(["short", "a somewhat longer text with padding at the end"])
    before, after = OrtRunner(fused_bert)(inputs), OrtRunner(packed)(inputs)
    assert np.allclose(before["sentence_embedding"], after["sentence_embedding"], atol=1e-5)

    quantized = tmp_path / "int8.onnx"
    quantize_dynamic(packed, quantized, op_types_to_quantize=["MatMul", "Attention"], weight_type=QuantType.QInt8)
    counts = int8_node_counts(quantized)
    assert counts["by_op"].get("QAttention") == 2 and "Attention (float)" not in counts["by_op"]
    plain = tmp_path / "plain-int8.onnx"
    quantize_dynamic(fused_bert, plain, op_types_to_quantize=["MatMul", "Attention"], weight_type=QuantType.QInt8)
    assert int8_node_counts(plain)["by_op"].get("Attention (float)") == 2  # unpacked: the quantizer skips it


def test_a_graph_without_fused_attention_is_left_alone(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["attention_mask"], ["y"])],
        "g",
        [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 4])],
    )
    source = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    assert pack_attention_qkv(source, tmp_path / "out.onnx") == (source, 0)
