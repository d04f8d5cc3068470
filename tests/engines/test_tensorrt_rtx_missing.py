"""Where the tensorrt-rtx extra (or cuda-python, or an RTX GPU) is missing, building and loading a
plan refuse with one line naming it. Runs on every machine: the module is hidden, not required."""

from __future__ import annotations

import importlib.util

import pytest

from engines.tensorrt_rtx import build as tensorrt_rtx_build
from engines.tensorrt_rtx import runner as tensorrt_rtx_runner


@pytest.fixture()
def no_tensorrt_rtx(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorrt_rtx" else real(name, *a)
    )


def test_the_build_names_the_missing_extra(no_tensorrt_rtx, tmp_path):
    with pytest.raises(
        tensorrt_rtx_build.BuildRefused, match=r"needs TensorRT-RTX \(pip install 'optimize\[tensorrt-rtx\]'"
    ):
        tensorrt_rtx_build.build_plan(tmp_path / "m.onnx", tmp_path / "m.plan", [], [])
    assert list(tmp_path.iterdir()) == []


def test_loading_a_plan_names_everything_missing(no_tensorrt_rtx, monkeypatch, tmp_path):
    monkeypatch.setattr(tensorrt_rtx_runner, "gpu_compute_capabilities", lambda: [("NVIDIA H200", "9.0")])
    lacking = tensorrt_rtx_runner.missing()
    assert lacking[0] == "TensorRT-RTX (the tensorrt-rtx wheel)"
    assert lacking[-1].endswith("this machine has NVIDIA H200 (compute capability 9.0)")  # Hopper is not RTX
    with pytest.raises(tensorrt_rtx_runner.Unavailable, match="^a TensorRT-RTX plan needs TensorRT-RTX"):
        tensorrt_rtx_runner.RtxPlanRunner(tmp_path / "m.plan")


def test_an_engine_block_of_the_format_refuses_as_engine_unavailable(monkeypatch, tmp_path):
    from engines import load_engine
    from engines.artifact import EngineUnavailable

    monkeypatch.setattr(tensorrt_rtx_runner, "gpu_compute_capabilities", lambda: [])
    (tmp_path / "model.plan").write_bytes(b"plan")
    with pytest.raises(EngineUnavailable, match="an RTX-class NVIDIA GPU \\(nvidia-smi finds none\\)"):
        load_engine(tmp_path, {"format": "tensorrt-rtx", "file": "model.plan"})
