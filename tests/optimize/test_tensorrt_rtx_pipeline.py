"""engine=tensorrt_rtx through the pipeline on a CPU: the plan is built ahead of time beside the ONNX
it came from, accuracy is measured on that ONNX (ONNX Runtime, CPU), the manifest says the plan's
latency was not measured, and a latency threshold fails as unmeasured. A graph TensorRT cannot take
is refused with one line naming the node. Small graphs, and the PP-OCR detector's Q/DQ graph at
64x64 (~10 s); the MiniLM FP16 preset runs in test_export_rtx.py, which bundles its plan."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'optimize[tensorrt-rtx]')")

from tests.support.cli import one_error_line, run_optimize  # noqa: E402

TENSOR_RUN = [
    "model.task=generic",
    "engine=tensorrt_rtx",
    "quantize=none",
    "gate=none",
    "gate.min_cosine=0.99",
    "evaluate.inputs=random",
    "calibration=random",
    "calibration.count=8",
    "evaluate.data.count=8",
    "evaluate.batch_sizes=[1,4]",
    "evaluate.memory=false",
]


def tiny_onnx(path: Path, odd_op: bool = False) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32) / 4, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32) / 4, "w2")
    last = helper.make_node("FusedMatMul" if odd_op else "MatMul", ["r", "w2"], ["y"], name="head")
    if odd_op:
        last.domain = "com.microsoft"  # ONNX Runtime runs it; TensorRT has no importer for it
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["r"]), last]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [w1, w2],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if odd_op else [])
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


def run(tmp_path: Path, name: str, *overrides: str):
    out = tmp_path / name
    proc = run_optimize(*overrides, f"output_dir={out}", f"hydra.run.dir={tmp_path / ('run-' + name)}")
    return proc, out


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8_qdq"])
def test_the_plan_ships_beside_the_onnx_it_was_built_from(tmp_path, precision):
    source = tiny_onnx(tmp_path / "tiny.onnx")
    proc, out = run(
        tmp_path,
        precision,
        f"model.source={source}",
        *TENSOR_RUN,
        f"engine.params.precision={precision}",
        "evaluate.latency=false",
        *(["gate.min_cosine=0.95"] if precision == "int8_qdq" else []),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    engine, stage = manifest["engine"], manifest["stages"]["engine"]
    assert engine["format"] == "onnxruntime" and engine["file"] == "model.onnx"
    plan = engine["plan"]
    assert plan["file"] == "model.plan" and plan["built_from"] == "model.onnx" and plan["precision"] == precision
    assert "ONNX Runtime on CPU" in plan["accuracy"] and plan["latency"].startswith("not measured")
    # one profile per evaluated batch size: batch 1, then 2..4 optimized for 4
    assert plan["profiles"] == [{"x": [[1, 16], [1, 16], [1, 16]]}, {"x": [[2, 16], [4, 16], [4, 16]]}]
    assert stage["build"]["unsupported"]["nodes"] == [] and stage["build"]["plan_bytes"] > 1000
    files = {f["path"] for f in manifest["files"]}
    assert {"model.onnx", "model.plan"} <= files
    if precision == "int8_qdq":
        assert manifest["stages"]["quantize"]["method"] == "ort_int8_static_qdq"
    verify = run_optimize_verify(out)
    assert verify.returncode == 0, verify.stderr


def run_optimize_verify(artifact: Path):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "optimize.verify", str(artifact)], capture_output=True, text=True)


def test_a_latency_threshold_fails_as_unmeasured(tmp_path):
    """Even when the recipe times the run: the CPU timings of the ONNX graph are not the plan's."""
    source = tiny_onnx(tmp_path / "tiny.onnx")
    proc, out = run(
        tmp_path,
        "timed",
        f"model.source={source}",
        *TENSOR_RUN,
        "engine.params.precision=fp32",
        "evaluate.latency=true",
        "evaluate.warmup=1",
        "evaluate.repeats=3",
        "gate.min_speedup=0.01",
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    candidate = manifest["metrics"]["candidate"]
    assert "latency" not in candidate and "speedup" not in candidate
    assert candidate["speed_note"].startswith("not measured: model.plan needs")
    check = next(c for c in manifest["gate"]["checks"] if c["name"].startswith("min_speedup"))
    assert not check["passed"] and check["value"] is None


def test_a_node_tensorrt_cannot_build_is_refused_by_name(tmp_path):
    source = tiny_onnx(tmp_path / "odd.onnx", odd_op=True)
    proc, out = run(tmp_path, "odd", f"model.source={source}", *TENSOR_RUN, "evaluate.latency=false")
    one_error_line(proc, "TensorRT-RTX cannot build model.onnx", "head (com.microsoft::FusedMatMul)", log_lines=True)
    assert not out.exists()


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("engine.params.precision=int4", "engine.params.precision=int4 (use fp32, fp16, int8_qdq)"),
        ("engine.params.compute_capabilities=[SM90]", "compute_capabilities has ['SM90']"),
        ("engine.params.quantize_params.calibrate_method=max", "engine.params.quantize_params.calibrate_method=max"),
    ],
)
def test_bad_parameters_are_one_line_before_any_weights_load(tmp_path, override, fragment):
    proc, out = run(tmp_path, "bad", "recipe=minilm_int8_rtx", override)
    one_error_line(proc, fragment)
    assert not out.exists()


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"activation_type": "uint8"}, "quantize_params.activation_type=uint8: TensorRT reads symmetric INT8"),
        ({"optimize_graph": "bert"}, "com.microsoft ops, which TensorRT cannot build"),
        ({"bogus": 1}, "engine.params.quantize_params.bogus is not a parameter of ort_int8_static_qdq"),
    ],
)
def test_quantize_params_tensorrt_cannot_read_are_refused(params, fragment):
    from optimize.compile.tensorrt_rtx import TensorrtRtxConfig
    from optimize.errors import RecipeError

    with pytest.raises(RecipeError, match=re.escape(fragment)):
        TensorrtRtxConfig(precision="int8_qdq", quantize_params=params).validate()


def test_ppocr_detector_qdq_graph_builds(tmp_path):
    pytest.importorskip("rapidocr_onnxruntime")
    pytest.importorskip("skimage")
    proc, out = run(
        tmp_path,
        "ppocr",
        "recipe=ppocr_det_int8_rtx",
        "model.inputs.x.shape=[N,3,64,64]",
        "calibration.image.size=[64,64]",
        "evaluate.data.image.size=[64,64]",
        "calibration.count=4",
        "engine.params.quantize_params.calibration_count=4",
        "evaluate.batch_sizes=[1]",
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # the gate judges masks
    manifest = json.loads((out / "manifest.json").read_text())
    stage = manifest["stages"]["engine"]
    assert stage["precision"] == "int8_qdq" and stage["int32_dequantize_folded"] > 0  # the Conv biases
    assert stage["build"]["plan_bytes"] > 0 and (out / "model.plan").is_file()
    assert manifest["engine"]["plan"]["profiles"] == [{"x": [[1, 3, 64, 64]] * 3}]
