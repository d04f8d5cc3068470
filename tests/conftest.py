"""Shared fixtures. The real pipeline builds one small MiniLM artifact per test session; tests that
need an artifact reuse it instead of rebuilding (export alone takes ~20 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import FAST_OVERRIDES, run_optimize


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory) -> Path:
    """A real INT8 MiniLM artifact built by the pipeline (fast settings)."""
    workdir = tmp_path_factory.mktemp("minilm")
    out = workdir / "artifact"
    proc = run_optimize(
        "recipe=minilm_int8_cpu", *FAST_OVERRIDES, f"output_dir={out}", f"hydra.run.dir={workdir / 'run'}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def openvino_artifact(tmp_path_factory) -> Path:
    """A real OpenVINO (NNCF INT8) MiniLM artifact built by the pipeline (fast settings)."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    workdir = tmp_path_factory.mktemp("minilm-openvino")
    out = workdir / "artifact"
    overrides = [o for o in FAST_OVERRIDES if not o.startswith(("engine=", "quantize"))]
    proc = run_optimize(
        "recipe=minilm_int8_cpu",
        *overrides,
        "quantize=none",
        "engine=openvino",
        "engine.params.precision=int8",
        "engine.params.calibration_count=16",
        f"output_dir={out}",
        f"hydra.run.dir={workdir / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out
