"""Fixtures for the serve tests. The MiniLM artifact comes from tests/conftest.py (the real
pipeline); the tiny causal LM is built by tests/support/tiny_llm.py with onnxruntime-genai's builder (about 20 s)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.serve import ROOT, in_process


@pytest.fixture(scope="session")
def tiny_llm_artifact(tmp_path_factory) -> Path:
    if importlib.util.find_spec("onnxruntime_genai") is None:
        pytest.skip("onnxruntime-genai is not installed")
    out = tmp_path_factory.mktemp("tiny_llm") / "artifact"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.tiny_llm", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def encoder_artifact(request) -> Path:
    """The real MiniLM artifact from the pipeline (tests/conftest.py), or a prebuilt one named by
    SERVE_TEST_ARTIFACT (to iterate on serve/ without rebuilding; tests never modify it)."""
    prebuilt = os.environ.get("SERVE_TEST_ARTIFACT")
    if prebuilt:
        return Path(prebuilt)
    return request.getfixturevalue("minilm_artifact")


@pytest.fixture(scope="module")
def encoder(encoder_artifact):
    """In-process app serving the MiniLM artifact, model loaded."""
    with in_process(encoder_artifact) as client:
        yield client


@pytest.fixture(scope="module")
def llm(tiny_llm_artifact):
    """In-process app serving the tiny causal LM, model loaded."""
    with in_process(tiny_llm_artifact, max_tokens=64) as client:
        yield client


@pytest.fixture(scope="session")
def encoder_name(encoder_artifact) -> str:
    from engines.artifact import read_manifest

    return read_manifest(encoder_artifact)["recipe"]["name"]
