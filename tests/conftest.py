"""Shared fixtures. The real pipeline builds one small MiniLM artifact per test session; tests that
need an artifact reuse it instead of rebuilding (export alone takes ~20 s on 2 cores)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# A quick variant of the default recipe: fewer evaluation samples, no sensitivity search, no
# latency or memory runs. The gate still checks fidelity, so the artifact is a real passing one.
FAST_OVERRIDES = [
    "evaluate.data.count=16", "evaluate.latency=false", "evaluate.memory=false",
    "quantize.params.fallback_min_cosine=null", "gate.min_speedup=null",
    "gate.min_cosine=0.95", "gate.min_mean_cosine=0.98", "gate.min_topk_agreement=0.5",
    "calibration.count=16",
]


def run_optimize(*overrides: str, cwd: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m optimize ...` as a user runs it, in a subprocess."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "optimize", *overrides], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory) -> Path:
    """A real INT8 MiniLM artifact built by the pipeline (fast settings)."""
    workdir = tmp_path_factory.mktemp("minilm")
    out = workdir / "artifact"
    proc = run_optimize("recipe=minilm_int8_cpu", *FAST_OVERRIDES, f"output_dir={out}",
                        f"hydra.run.dir={workdir / 'run'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out
