"""ONNX Runtime sessions run on the provider they were asked for, or are refused with one line.

onnxruntime-gpu on a machine without a usable GPU lists the CUDA and TensorRT providers, creates the
session and runs it on the CPU without a word. The real wheel is tested in a virtual environment
of its own (it installs the same `onnxruntime` module as the CPU wheel, so it never goes into the
project's): ORT_GPU_PYTHON names its interpreter, else /tmp/ortgpu/bin/python; the test skips when
neither has onnxruntime-gpu (`python3 -m venv /tmp/ortgpu && /tmp/ortgpu/bin/pip install
onnxruntime-gpu numpy`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_PYTHON = Path(os.environ.get("ORT_GPU_PYTHON", "/tmp/ortgpu/bin/python"))

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import onnxruntime as ort
from engines.onnxruntime.runner import OrtRunner
from engines.onnxruntime.providers import ProviderFallback

results = {"available": ort.get_available_providers(), "refused": {}}
for provider in ("TensorrtExecutionProvider", "CUDAExecutionProvider"):
    try:
        runner = OrtRunner(sys.argv[2], providers=[provider, "CPUExecutionProvider"], cache_root=sys.argv[3])
        results["refused"][provider] = None
        results.setdefault("ran_on", {})[provider] = runner.session.get_providers()
    except ProviderFallback as exc:
        results["refused"][provider] = str(exc)
runner = OrtRunner(sys.argv[2])
results["cpu"] = runner({"x": [[1.0, 2.0, 3.0, 4.0]]})["y"].tolist()
print(json.dumps(results))
"""


def tiny_onnx(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [weights],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


def gpu_wheel() -> str:
    if not GPU_PYTHON.is_file():
        pytest.skip(f"no separate onnxruntime-gpu environment at {GPU_PYTHON} (set ORT_GPU_PYTHON)")
    proc = subprocess.run(
        [str(GPU_PYTHON), "-c", "import importlib.metadata as m; print(m.version('onnxruntime-gpu'))"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"{GPU_PYTHON} has no onnxruntime-gpu")
    return proc.stdout.strip()


def test_the_silent_cpu_fallback_of_onnxruntime_gpu_is_caught(tmp_path):
    version = gpu_wheel()
    from engines.hardware import gpus

    if gpus():
        pytest.skip("this machine has an NVIDIA GPU: the providers may really start here")
    model = tiny_onnx(tmp_path / "m.onnx")
    proc = subprocess.run(
        [str(GPU_PYTHON), "-c", SCRIPT, str(ROOT), str(model), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    # The wheel offers both GPU providers on a machine with no GPU...
    assert {"TensorrtExecutionProvider", "CUDAExecutionProvider"} <= set(results["available"]), version
    # ...and each session asked for one is refused, naming where it would have run instead.
    for provider, message in results["refused"].items():
        assert message is not None, f"{provider} session was not refused: ran on {results.get('ran_on')}"
        assert message.startswith(f"ONNX Runtime was asked for {provider} and runs on CPUExecutionProvider")
        assert "\n" not in message
    assert results["cpu"] == [[60.0, 70.0, 80.0]]  # the CPU provider asked for is kept


def test_a_provider_missing_from_this_onnxruntime_is_refused_not_replaced(tmp_path):
    """The CPU wheel has no TensorRT provider at all: refused, never run on the next in the list."""
    import onnxruntime as ort

    from engines.onnxruntime.providers import ProviderFallback
    from engines.onnxruntime.runner import OrtRunner

    if "TensorrtExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the TensorRT provider")
    with pytest.raises(ProviderFallback, match="TensorrtExecutionProvider is not in this onnxruntime"):
        OrtRunner(tiny_onnx(tmp_path / "m.onnx"), providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])


def test_check_active_reads_the_first_active_provider():
    from engines.onnxruntime.providers import ProviderFallback, check_active

    class Session:
        def __init__(self, active):
            self.active = active

        def get_providers(self):
            return self.active

    check_active(Session(["CUDAExecutionProvider", "CPUExecutionProvider"]), "CUDAExecutionProvider")
    with pytest.raises(ProviderFallback, match="asked for CUDAExecutionProvider and runs on CPUExecutionProvider"):
        check_active(Session(["CPUExecutionProvider"]), "CUDAExecutionProvider")


def test_tensorrt_caches_live_in_the_artifact(tmp_path):
    from engines.onnxruntime.providers import provider_options

    options = provider_options(["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"], tmp_path)
    trt = options[0]
    assert trt["trt_engine_cache_path"] == trt["trt_timing_cache_path"] == str(tmp_path / "trt_cache")
    assert trt["trt_engine_cache_enable"] == trt["trt_timing_cache_enable"] == "True"
    assert options[1:] == [{}, {}]
