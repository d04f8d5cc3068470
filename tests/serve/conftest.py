"""Fixtures for the serve tests. The MiniLM artifact comes from tests/conftest.py (the real
pipeline); the tiny causal LM is built by tests/support/tiny_llm.py with onnxruntime-genai's builder (about 20 s)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.support.serve import in_process
from tests.support.shared import build_once
from tests.support.tiny_llm import build_in_subprocess


@pytest.fixture(scope="session")
def tiny_llm_artifact(tmp_path_factory) -> Path:
    if importlib.util.find_spec("onnxruntime_genai") is None:
        pytest.skip("onnxruntime-genai is not installed")
    return built_tiny_llm(tmp_path_factory, "tiny_llm")


@pytest.fixture(scope="session")
def tiny_ov_llm_artifact(tmp_path_factory) -> Path:
    """The same tiny Llama as an OpenVINO GenAI artifact (continuous batching); a few seconds."""
    if any(importlib.util.find_spec(m) is None for m in ("openvino", "openvino_genai", "openvino_tokenizers")):
        pytest.skip("openvino-genai is not installed")
    return built_tiny_llm(tmp_path_factory, "tiny_ov_llm", "--openvino")


def built_tiny_llm(tmp_path_factory, name: str, *flags: str) -> Path:
    """The tiny causal-LM artifact (tests/support/tiny_llm.py), built once per test run."""

    def build(workdir: Path) -> dict:
        build_in_subprocess(workdir / "artifact", *flags)
        return {}

    workdir, _ = build_once(tmp_path_factory, name, build)
    return workdir / "artifact"


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


@pytest.fixture(scope="session")
def tensor_artifact(tmp_path_factory) -> Path:
    """A tensor model ("bring your own ONNX") through the real pipeline: y[n, 3] = x[n, 4] @ W, with
    W = arange(12) / 10. Tiny on purpose (seconds to build); its answers are known offline."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tests.support.cli import run_optimize

    def build(workdir: Path) -> dict:
        weights = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "matmul",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
            [weights],
        )
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(workdir / "matmul.onnx"))
        out = workdir / "artifact"
        proc = run_optimize(
            f"model.source={workdir / 'matmul.onnx'}",
            "model.task=generic",
            "engine=onnx",
            "quantize=none",
            "gate=none",
            "gate.min_cosine=0.99",
            "evaluate.inputs=random",
            "calibration=random",
            "evaluate.data.count=4",
            "evaluate.batch_sizes=[1]",
            "evaluate.latency=false",
            "evaluate.memory=false",
            f"output_dir={out}",
            f"hydra.run.dir={workdir / 'run'}",
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return {}

    workdir, _ = build_once(tmp_path_factory, "tensor", build)
    return workdir / "artifact"
