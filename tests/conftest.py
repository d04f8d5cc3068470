"""Shared fixtures. The real pipeline builds one small MiniLM artifact per test session; tests that
need an artifact reuse it instead of rebuilding (export alone takes ~20 s on 2 cores)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
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


@dataclass(frozen=True)
class FailedRun:
    proc: subprocess.CompletedProcess
    artifact: Path
    junit: Path  # report.junit
    summary: Path  # GITHUB_STEP_SUMMARY
    outputs: Path  # GITHUB_OUTPUT


@pytest.fixture(scope="session")
def failed_gate_run(tmp_path_factory) -> FailedRun:
    """A real MiniLM run whose gate fails (min_cosine above 1 cannot pass), as CI runs it: with
    report.junit, GitHub's step summary and output files, and publish=mlflow allowing a failed gate
    (the embedded store beside the artifact)."""
    workdir = tmp_path_factory.mktemp("minilm-failed")
    artifact, junit = workdir / "out" / "artifact", workdir / "reports" / "junit.xml"
    summary, outputs = workdir / "step_summary.md", workdir / "step_output"
    summary.write_text("# earlier step\n")  # appended to, never replaced
    proc = run_optimize(
        "recipe=minilm_int8_cpu",
        *FAST_OVERRIDES,
        "gate.min_cosine=1.01",
        f"output_dir={artifact}",
        f"hydra.run.dir={workdir / 'run'}",
        f"report.junit={junit}",
        "publish=mlflow",
        "publish.allow_failed=true",
        env={"GITHUB_STEP_SUMMARY": str(summary), "GITHUB_OUTPUT": str(outputs)},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return FailedRun(proc, artifact, junit, summary, outputs)


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
