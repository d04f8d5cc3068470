"""Each quantize method on a tiny ONNX model (built in-process, no export): setup, execute, assert."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from optimize import registry
from optimize.context import Model
from optimize.errors import RecipeError
from tests.support.context import onnx_context

onnx = pytest.importorskip("onnx")


def _tiny_mlp(path: Path, width: int = 64, seed: int = 0) -> Path:
    """x[N, width] -> MatMul -> Add -> Relu -> MatMul -> y[N, 16], weights seeded."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32) / 8, "w1"),
        numpy_helper.from_array(rng.standard_normal(width).astype(np.float32) / 8, "b1"),
        numpy_helper.from_array(rng.standard_normal((width, 16)).astype(np.float32) / 8, "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu1"),
        helper.make_node("MatMul", ["h2", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture()
def mlp(tmp_path):
    (tmp_path / "src").mkdir()
    return Model("torch", "generic").with_onnx(_tiny_mlp(tmp_path / "src" / "model.onnx"))


def _run(method: str, model, ctx, **params):
    m = registry.get("quantize", method)
    return m.fn(model, registry.build_config(m, params), ctx)


def _outputs(path: Path, x: np.ndarray) -> np.ndarray:
    from engines.onnxruntime.runner import OrtRunner

    return OrtRunner(path, threads=1)({"x": x})["y"]


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    from engines.similarity import cosine_rows

    return float(cosine_rows(a, b).min())


def _ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


X_TEST = np.random.default_rng(99).standard_normal((16, 64)).astype(np.float32)


@pytest.mark.parametrize("calibrate_method", ["minmax", "entropy", "percentile"])
def test_static_qdq_calibrates_and_stays_close(mlp, tmp_path, calibrate_method):
    ctx = onnx_context(tmp_path)
    out = _run("ort_int8_static_qdq", mlp, ctx, calibrate_method=calibrate_method, calibration_count=16)
    assert out.precision == "int8" and {"QuantizeLinear", "DequantizeLinear"} <= _ops(out.onnx_path)
    assert _min_cosine(_outputs(mlp.onnx_path, X_TEST), _outputs(out.onnx_path, X_TEST)) > 0.98
    record = out.record
    assert record["calibrate_method"] == calibrate_method and record["calibration_items"] == 16
    assert record["activations"] == "uint8 static"


def test_static_qdq_s8s8_and_excluded_node(mlp, tmp_path):
    ctx = onnx_context(tmp_path)
    out = _run("ort_int8_static_qdq", mlp, ctx, activation_type="int8", nodes_to_exclude=["fc2"], reduce_range=False)
    graph = onnx.load(str(out.onnx_path)).graph
    fc2 = next(n for n in graph.node if n.name == "fc2")
    assert "w2" in fc2.input  # excluded: still multiplies the FP32 weight
    assert out.record["reduce_range"] is False


def test_static_qdq_sensitivity_fallback_keeps_nodes_fp32(mlp, tmp_path):
    ctx = onnx_context(tmp_path)
    out = _run("ort_int8_static_qdq", mlp, ctx, fallback_min_cosine=1.0, max_fp32_nodes=1, sensitivity_samples=8)
    assert len(out.record["fp32_nodes"]) == 1  # unreachable target: stops at max_fp32_nodes


def test_static_qdq_rejects_bad_params():
    method = registry.get("quantize", "ort_int8_static_qdq")
    for params in (
        {"calibrate_method": "mse"},
        {"activation_type": "int4"},
        {"optimize_graph": "gpt2"},
        {"percentile": 10.0},
        {"calibration_count": 0},
    ):
        with pytest.raises(RecipeError):
            registry.build_config(method, params)


def test_dynamic_int8_still_works(mlp, tmp_path):
    ctx = onnx_context(tmp_path)
    out = _run("ort_int8_dynamic", mlp, ctx, fallback_min_cosine=None)
    assert _min_cosine(_outputs(mlp.onnx_path, X_TEST), _outputs(out.onnx_path, X_TEST)) > 0.98


def test_fp16_on_cpu_converts_weights(mlp, tmp_path):
    ctx = onnx_context(tmp_path)
    out = _run("ort_fp16", mlp, ctx, execution_provider="CPUExecutionProvider")
    model = onnx.load(str(out.onnx_path))
    assert {i.data_type for i in model.graph.initializer} == {onnx.TensorProto.FLOAT16}
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # keep_io_types
    assert out.precision == "fp16" and out.engine["providers"] == ["CPUExecutionProvider"]
    assert _min_cosine(_outputs(mlp.onnx_path, X_TEST), _outputs(out.onnx_path, X_TEST)) > 0.999


def test_fp16_for_a_missing_gpu_provider_is_one_clear_error():
    from engines.onnxruntime.providers import missing_for

    if not missing_for("TensorrtExecutionProvider"):
        pytest.skip("this machine has a GPU with TensorRT")
    with pytest.raises(RecipeError, match="lacks .*TensorRT"):
        registry.build_config(registry.get("quantize", "ort_fp16"), {"execution_provider": "TensorrtExecutionProvider"})


@pytest.mark.parametrize(
    "params",
    [
        {"algorithm": "rtn", "symmetric": True},
        {"algorithm": "rtn", "symmetric": False},
        {"algorithm": "hqq"},
        {"algorithm": "gptq", "calibration_count": 8},
    ],
)
def test_int4_weight_only_packs_matmuls(mlp, tmp_path, params):
    ctx = onnx_context(tmp_path)
    out = _run("ort_int4_weight_only", mlp, ctx, block_size=32, **params)
    assert "MatMulNBits" in _ops(out.onnx_path) and "MatMul" not in _ops(out.onnx_path)
    assert out.precision == "int4" and out.record["matmulnbits_nodes"] == 2
    assert _min_cosine(_outputs(mlp.onnx_path, X_TEST), _outputs(out.onnx_path, X_TEST)) > 0.97
    assert out.onnx_path.stat().st_size < mlp.onnx_path.stat().st_size / 3


def test_int4_excluded_node_stays_matmul(mlp, tmp_path):
    out = _run("ort_int4_weight_only", mlp, onnx_context(tmp_path), nodes_to_exclude=["fc2"])
    assert {"MatMulNBits", "MatMul"} <= _ops(out.onnx_path)


def test_int4_rejects_bad_params():
    method = registry.get("quantize", "ort_int4_weight_only")
    for params in (
        {"block_size": 24},
        {"block_size": 8},
        {"algorithm": "awq"},
        {"algorithm": "hqq", "symmetric": True},
    ):
        with pytest.raises(RecipeError):
            registry.build_config(method, params)


def test_methods_need_an_onnx_model(tmp_path):
    torch_model = Model("torch", "generic", module=object())
    for method in ("ort_int8_static_qdq", "ort_int4_weight_only", "ort_fp16"):
        params = {"execution_provider": "CPUExecutionProvider"} if method == "ort_fp16" else {}
        with pytest.raises(RecipeError, match="needs an ONNX model"):
            _run(method, torch_model, onnx_context(tmp_path), **params)


def test_static_qdq_keeps_consumers_of_an_op_type_in_fp32(mlp, tmp_path):
    ctx = onnx_context(tmp_path)
    out = _run("ort_int8_static_qdq", mlp, ctx, exclude_consumers_of=["Relu"])
    assert out.record["excluded_nodes"] == ["fc2"]
    fc2 = next(n for n in onnx.load(str(out.onnx_path)).graph.node if n.name == "fc2")
    assert "w2" in fc2.input


def _gram_model(path: Path, width: int = 64) -> Path:
    """x -> fc1 (weight) -> h; gram = h @ h^T: a MatMul of two activations, like attention's Q@K^T."""
    from onnx import TensorProto, helper, numpy_helper

    w1 = numpy_helper.from_array(np.random.default_rng(0).standard_normal((width, width)).astype(np.float32) / 8, "w1")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Transpose", ["h"], ["ht"], name="t", perm=[1, 0]),
        helper.make_node("MatMul", ["h", "ht"], ["y"], name="gram"),
    ]
    graph = helper.make_graph(
        nodes,
        "gram",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "batch"])],
        [w1],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("const_b_only", [True, False])
def test_static_qdq_leaves_activation_by_activation_matmuls_fp32(tmp_path, const_b_only):
    model = Model("torch", "generic").with_onnx(_gram_model(tmp_path / "gram.onnx"))
    ctx = onnx_context(tmp_path)
    out = _run("ort_int8_static_qdq", model, ctx, matmul_const_b_only=const_b_only)
    graph = onnx.load(str(out.onnx_path)).graph
    producer = {o: n for n in graph.node for o in n.output}
    assert ("gram" in out.record["excluded_nodes"]) == const_b_only
    # Excluded, the MatMul's own output gets no Q/DQ pair (its inputs may still carry their
    # producers' pairs): the graph output comes straight from it.
    assert (producer["y"].op_type == "MatMul") == const_b_only


def test_static_ranking_uses_the_calibrated_range():
    """A clipped calibrated range hurts more than the tensor's own min/max, and the ranking sees it."""
    from optimize.quantize.sensitivity import _simulated_error

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32))
    x[0, 0] = 40.0  # one outlier, as GELU outputs have
    w = rng.standard_normal((32, 8))
    own_range = _simulated_error(x, w, per_channel=True, reduce_range=False)
    clipped = _simulated_error(x, w, per_channel=True, reduce_range=False, x_range=(-3.0, 3.0))
    assert clipped > 2 * own_range


def test_calibration_ranges_read_from_onnxruntime_cache(mlp, tmp_path):
    from optimize.quantize.ort_int8_static_qdq import read_calibration_ranges

    ctx = onnx_context(tmp_path)
    _run("ort_int8_static_qdq", mlp, ctx, calibrate_method="minmax")
    ranges = read_calibration_ranges(tmp_path / "quantize_static" / "calibration_ranges.json")
    x = np.stack(ctx.calibration().items)
    assert ranges["x"] == pytest.approx((x.min(), x.max()), rel=1e-5)


@pytest.mark.parametrize("method", ["ort_int8_dynamic", "ort_int8_static_qdq"])
def test_a_method_with_op_types_refuses_at_plan_time_what_the_graph_does_not_have(mlp, method):
    m = registry.get("quantize", method)
    refusal = m.refuses(registry.build_config(m, {"op_types": ["Conv"]}), mlp.onnx_path)
    assert refusal is not None and f"quantize.method={method} cannot apply" in refusal and "2 MatMul" in refusal
    assert m.refuses(registry.build_config(m, {"op_types": ["MatMul"]}), mlp.onnx_path) is None
    assert m.refuses(registry.build_config(m, {}), mlp.onnx_path) is None  # no op_types: the graph's own


def test_a_method_that_registers_no_refusal_refuses_nothing(mlp):
    m = registry.get("quantize", "ort_fp16")
    config = registry.build_config(m, {"execution_provider": "CPUExecutionProvider"})
    assert m.refusal is None and m.refuses(config, mlp.onnx_path) is None
