"""The race's served timing on a real server (tiny random Llama, ONNX Runtime GenAI's static batches of
4): requests queued behind whole batches are timed, not cut by the server's default timeout, and a
load that fails says where and why."""

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
    from engines.artifact import read_manifest
    from optimize.artifact import write_manifest

    out = tmp_path_factory.mktemp("race_served") / "tiny"
    build_in_subprocess(out)
    engine = read_manifest(out)["engine"]
    (out / "manifest.json").unlink()
    write_manifest(out, {"recipe": {"name": "tiny", "resolved": {}}, "engine": engine})
    return out


def _load() -> workload.Workload:
    cfg = OmegaConf.create(
        {
            "gate": {},
            "evaluate": {"batch_sizes": [1]},
            "workload": {"requests": [{"prompt": PROMPT, "output": OUTPUT}], "concurrency": [CLIENTS]},
        }
    )
    return workload.resolve(cfg)


def _drive(artifact: Path, server_timeout_s: float | None = None) -> dict:
    """One cell as the race times it: the server started as the race starts it (with its request
    timeout replaced by `server_timeout_s` where given; the clients' stays), warmed, then driven."""
    prompts = [[(7 * i + 13 * j) % 200 + 5 for j in range(PROMPT)] for i in range(CLIENTS)]
    with pytest.MonkeyPatch.context() as patch:
        if server_timeout_s is not None:
            patch.setattr(served, "REQUEST_TIMEOUT_S", server_timeout_s)
        server = served._Server(artifact, 1)
    try:
        server.start(prompts[:1])
        return served._cell(server.drive(prompts, CLIENTS, 1, OUTPUT), 0.0)
    finally:
        server.stop()


def test_requests_queued_behind_static_batches_are_timed_and_a_failed_load_names_its_error(artifact):
    from serve.config import ServeConfig

    # The race's server waits longer than serve's default for a request, queueing included.
    assert served.REQUEST_TIMEOUT_S > ServeConfig().timeout_s
    cell = _drive(artifact)
    assert cell["failed"] == 0 and cell["requests"] == CLIENTS and cell["request_ms"] > 0

    # The server's timeout is the race's: shorter than a batch takes, queued requests are 504s
    # (what serve's 30 s did to SmolLM2 at 1024 + 128 tokens), and the report says so, not "inf x".
    cell = _drive(artifact, server_timeout_s=0.05)
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
