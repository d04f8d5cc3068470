"""TensorRT-RTX plans built ahead of time on a CPU (no GPU needed to build): tiny graphs in FP32,
FP16 and Q/DQ INT8, one optimization profile each, refusals that name the node the builder cannot
take, and a native abort of the builder turned into one line instead of the caller's death."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'optimize[tensorrt-rtx]')")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from engines.tensorrt_rtx.build import BuildRefused, build_plan  # noqa: E402

PROFILES = [{"x": [[1, 16], [2, 16], [4, 16]]}, {"x": [[5, 16], [8, 16], [8, 16]]}]


def graph(path: Path, dtype=np.float32, odd_op: str | None = None, qdq: bool = False) -> Path:
    """x [N, 16] -> MatMul -> Relu [-> an op of another domain]; FP16 weights and input when asked."""
    rng = np.random.default_rng(0)
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(dtype), "w")]
    nodes = []
    source = "x"
    if qdq:  # symmetric INT8 Q/DQ on the activation and the weight, as TensorRT reads them
        inits += [
            numpy_helper.from_array(np.array(0.05, dtype=np.float32), "s"),
            numpy_helper.from_array(np.array(0, dtype=np.int8), "z"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="x_q"),
            helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="x_dq"),
            helper.make_node("QuantizeLinear", ["w", "s", "z"], ["wq"], name="w_q"),
            helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], name="w_dq"),
        ]
        source, weight = "xd", "wd"
    else:
        weight = "w"
    nodes += [
        helper.make_node("MatMul", [source, weight], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
    ]
    opsets = [helper.make_opsetid("", 17)]
    if odd_op:
        nodes.append(helper.make_node(odd_op, ["r", "w"], ["y"], name="odd_node", domain="com.microsoft"))
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    else:
        nodes.append(helper.make_node("Identity", ["r"], ["y"], name="out"))
    g = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", elem, ["N", 16])],
        [helper.make_tensor_value_info("y", elem, ["N", 16])],
        inits,
    )
    onnx.save(helper.make_model(g, opset_imports=opsets), str(path))
    return path


@pytest.mark.parametrize("kind", ["fp32", "fp16", "qdq"])
def test_plans_build_on_a_cpu_with_one_profile_per_batch_range(tmp_path, kind):
    source = graph(tmp_path / "m.onnx", np.float16 if kind == "fp16" else np.float32, qdq=kind == "qdq")
    report = build_plan(source, tmp_path / "m.plan", PROFILES, [])
    plan = tmp_path / "m.plan"
    assert plan.is_file() and plan.stat().st_size == report["plan_bytes"] > 1000
    assert report["profiles"] == PROFILES and report["unsupported"] == {"nodes": [], "subgraphs": [], "errors": []}
    assert report["inputs"][0]["dtype"] == ("half" if kind == "fp16" else "float")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.plan"]  # no request or report left


def test_named_compute_capabilities_build_too(tmp_path):
    report = build_plan(graph(tmp_path / "m.onnx"), tmp_path / "m.plan", PROFILES[:1], ["SM86", "SM120"])
    assert report["compute_capabilities"] == ["SM86", "SM120"]


def test_an_op_of_another_domain_is_refused_naming_the_node(tmp_path):
    with pytest.raises(BuildRefused) as refused:
        build_plan(graph(tmp_path / "m.onnx", odd_op="FusedMatMul"), tmp_path / "m.plan", PROFILES, [])
    message = str(refused.value)
    assert "odd_node (com.microsoft::FusedMatMul)" in message and "\n" not in message
    assert [n["name"] for n in refused.value.report["unsupported"]["nodes"]] == ["odd_node"]
    assert not (tmp_path / "m.plan").exists()


def test_a_profile_naming_no_input_is_refused(tmp_path):
    with pytest.raises(BuildRefused, match=r"profile names \['z'\], not inputs of the graph"):
        build_plan(graph(tmp_path / "m.onnx"), tmp_path / "m.plan", [{"z": [[1, 16], [1, 16], [1, 16]]}], [])


def test_turing_cannot_take_fp32_gemms_and_says_so(tmp_path):
    """A builder error (not a parser one): the last line TensorRT logged, on one line."""
    with pytest.raises(BuildRefused, match="FP32 GEMM is not supported") as refused:
        build_plan(graph(tmp_path / "m.onnx"), tmp_path / "m.plan", PROFILES, ["SM75"])
    assert "\n" not in str(refused.value)


def test_a_native_abort_of_the_builder_is_one_line_not_the_callers_death(tmp_path, monkeypatch):
    """Standard TensorRT aborts the process when it finds no CUDA device; the build runs in a child."""
    aborting = tmp_path / "python"
    aborting.write_text("#!/bin/sh\necho 'terminate called' >&2\nkill -ABRT $$\n")
    aborting.chmod(aborting.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("engines.tensorrt_rtx.build.sys.executable", str(aborting))
    with pytest.raises(BuildRefused, match=r"stopped \(signal 6\).*terminate called"):
        build_plan(graph(tmp_path / "m.onnx"), tmp_path / "m.plan", PROFILES, [])
    assert not (tmp_path / "m.plan").exists()


def test_the_runner_refuses_without_an_rtx_gpu_naming_what_is_missing(tmp_path):
    from engines.tensorrt_rtx.runner import RtxPlanRunner, Unavailable, missing

    lacking = missing()
    if not lacking:
        pytest.skip("this machine can run TensorRT-RTX plans")
    build_plan(graph(tmp_path / "m.onnx"), tmp_path / "m.plan", PROFILES, [])
    with pytest.raises(Unavailable) as refused:
        RtxPlanRunner(tmp_path / "m.plan")
    assert str(refused.value) == "a TensorRT-RTX plan needs " + "; ".join(lacking)
