"""A foreign ONNX file (a small convolutional model with dynamic H and W, as text detectors are): every
refusal known at plan time comes in one message, exit 2, and once they are fixed the default op types
are the weighted ops the graph has (Conv here), as the report says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import one_error_line, run_optimize


def conv_model(path: Path) -> Path:
    """x [N, 3, H, W] -> Conv 3x3 (8) -> Relu -> Conv 3x3 (4): every weight in a convolution."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, "H", "W"])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


COMMON = (
    "model.task=generic",
    "engine=onnx",
    "gate=none",
    "gate.min_cosine=0.9",
    "evaluate.data.count=8",
    "evaluate.batch_sizes=[1]",
    "evaluate.latency=false",
    "evaluate.memory=false",
    "quantize=ort_int8_dynamic",
    "quantize.params.fallback_min_cosine=null",
)


@pytest.fixture(scope="module")
def conv_onnx(tmp_path_factory) -> Path:
    return conv_model(tmp_path_factory.mktemp("conv") / "conv.onnx")


def test_every_plan_time_refusal_comes_in_one_message(conv_onnx, tmp_path):
    proc = run_optimize(
        f"model.source={conv_onnx}",
        *COMMON,
        "evaluate.inputs=random",
        "quantize.params.op_types=[MatMul,Gemm]",
        "quantize.params.fallback_min_cosine=0.995",  # the sensitivity fallback reads calibration samples
        f"output_dir={tmp_path / 'out'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = one_error_line(
        proc,
        "3 things to fix before this recipe can run on this model",
        "(1) model input 'x' dim 2 is symbolic (H)",
        "'++model.inputs.x.shape=[N,3,64,64]'",
        "(2) calibration.source=cpython_docs gives text",
        "(3) quantize.method=ort_int8_dynamic cannot apply",
        "op_types=[MatMul, Gemm] matches none of the graph's weighted nodes (2 Conv)",
    )
    assert "internal error" not in line and not (tmp_path / "out").exists()


def test_fixed_as_advised_the_op_types_default_to_the_graphs_weighted_ops(conv_onnx, tmp_path):
    out = tmp_path / "out"
    proc = run_optimize(
        f"model.source={conv_onnx}",
        *COMMON,
        "evaluate.inputs=random",
        "calibration=random",
        "++model.inputs.x.shape=[N,3,32,32]",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    quantize = json.loads((out / "manifest.json").read_text())["stages"]["quantize"]
    assert quantize["op_types"] == ["Conv"] and quantize["op_types_from"] == "graph"
    assert quantize["kernels"]["int8"] == 2  # both convolutions quantized (ConvInteger)
    assert "quantized op types: Conv (the graph's weighted ops)" in proc.stdout
