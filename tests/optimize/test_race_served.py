"""The race's served timing on a real server (tiny random Llama, ONNX Runtime GenAI's static batches of
4): requests queued behind whole batches are timed, not cut by serve's default timeout for a model
that generates, and a load that fails says where and why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from optimize import workload
from optimize.compile.race import served
from optimize.compile.race.candidates import CANDIDATES
from optimize.compile.race.entry import Entry
from tests.support.tiny_llm import build_in_subprocess

CLIENTS, PROMPT, OUTPUT = 16, 40, 200  # 16 / 4 = four static batches, each 200 decode steps long


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """The tiny ONNX Runtime GenAI artifact, as the race's minimal served artifact (server defaults)."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        pytest.skip("onnxruntime-genai is not installed")
    out = tmp_path_factory.mktemp("race_served") / "tiny"
    build_in_subprocess(out)
    _rewrite_manifest(out, {})
    return out


def _rewrite_manifest(folder: Path, serve: dict) -> None:
    """The minimal manifest the race writes, with the recipe's `serve` block given."""
    from engines.artifact import read_manifest
    from optimize.artifact import write_manifest

    engine = read_manifest(folder)["engine"]
    (folder / "manifest.json").unlink()
    write_manifest(
        folder, {"recipe": {"name": "tiny", "resolved": {"serve": serve} if serve else {}}, "engine": engine}
    )


def _load() -> workload.Workload:
    cfg = OmegaConf.create(
        {
            "gate": {},
            "evaluate": {"batch_sizes": [1]},
            "workload": {"requests": [{"prompt": PROMPT, "output": OUTPUT}], "concurrency": [CLIENTS]},
        }
    )
    return workload.resolve(cfg)


def _drive(artifact: Path) -> dict:
    """One cell as the race times it: the server started as the race starts it, warmed, then driven."""
    prompts = [[(7 * i + 13 * j) % 200 + 5 for j in range(PROMPT)] for i in range(CLIENTS)]
    server = served._Server(artifact, 1)
    try:
        server.start(prompts[:1])
        return served._cell(server.drive(prompts, CLIENTS, 1, OUTPUT), 0.0)
    finally:
        server.stop()


def test_requests_queued_behind_static_batches_are_timed_and_a_failed_load_names_its_error(artifact, tmp_path):
    import shutil

    from engines.artifact import read_manifest
    from serve.config import GENERATION_TIMEOUT_S, ServeConfig, resolve

    # serve waits longer for a model that generates than for an encoder, queueing included, unless
    # the command line or the recipe says otherwise; the race serves with those defaults.
    assert GENERATION_TIMEOUT_S > ServeConfig().timeout_s
    assert resolve({}, read_manifest(artifact)).timeout_s == GENERATION_TIMEOUT_S
    assert resolve({"timeout_s": 7.0}, read_manifest(artifact)).timeout_s == 7.0
    assert resolve({}, {"engine": {"format": "onnx"}}).timeout_s == ServeConfig().timeout_s
    cell = _drive(artifact)
    assert cell["failed"] == 0 and cell["requests"] == CLIENTS and cell["request_ms"] > 0

    # A timeout shorter than a batch takes (the recipe's, here): queued requests are 504s (what
    # serve's 30 s did to SmolLM2 at 1024 + 128 tokens), and the report says so, not "inf x".
    short = tmp_path / "short" / artifact.name  # the race names the served model after its folder
    shutil.copytree(artifact, short)
    _rewrite_manifest(short, {"timeout_s": 0.05})
    cell = _drive(short)
    assert cell["failed"] > 0 and cell["request_ms"] is None
    entry = Entry("ort_genai_int4", CANDIDATES["ort_genai_int4"])
    load = _load()
    entry.metrics["served"] = {load.requests[0].key: {load.concurrency[0].key: cell}}
    failure = served.load_failure(entry, load)
    assert failure is not None
    assert failure.startswith(
        f"{cell['failed']}/{CLIENTS} requests failed at {CLIENTS} client(s), shape {PROMPT}x{OUTPUT}: "
    )
    assert "did not finish within 0.05 s" in failure
