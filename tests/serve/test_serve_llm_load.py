"""The served-load driver (optimize/evaluate/served.py, used by benchmarks/serve_llm_load.py and a
served-latency gate) on the tiny OpenVINO GenAI artifact: every request answered and counted, the
figures present, clients that leave after their first token counted as answered."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.serve import running_server

NAME = "tiny_llm"
TEXTS = ["def main():", "The return statement", "A class definition", "import sys"] * 2


@pytest.fixture(scope="module")
def prompts(tiny_ov_llm_artifact) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_ov_llm_artifact / "ov" / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in TEXTS]


def test_drive_measures_every_request(tiny_ov_llm_artifact, prompts):
    from optimize.evaluate.served import drive, drive_async

    with running_server(tiny_ov_llm_artifact, "--max-tokens", "16") as server:
        figures = drive(server.url, NAME, prompts, clients=4, per_client=2, new_tokens=8, timeout_s=60)
        assert figures["requests"] == 8 and figures["failed"] == 0, figures
        assert 0 < figures["output_tokens"] <= 8 * 8
        assert figures["tokens_per_s"] > 0 and figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        results, _ = asyncio.run(drive_async(server.url, NAME, prompts, 4, 1, 8, 60, leave_share=0.5))
        assert [r.status for r in results] == [200] * 4 and not any(r.error for r in results)
        bad = drive(server.url, "no-such-model", prompts, clients=1, per_client=1, new_tokens=8, timeout_s=60)
        assert bad["failed"] == 1 and "does not exist" in bad["errors"][0]


def test_served_load_starts_and_stops_the_server(tiny_ov_llm_artifact, prompts):
    from optimize.evaluate.served import served_load

    figures = served_load(tiny_ov_llm_artifact, prompts, clients=2, requests_per_client=1, new_tokens=4)
    assert figures["requests"] == 2 and figures["failed"] == 0, figures


def test_a_structured_share_constrains_that_share_and_every_reply_validates(tiny_ov_llm_artifact, prompts):
    from optimize.evaluate.served import drive

    with running_server(tiny_ov_llm_artifact, "--max-tokens", "48") as server:
        figures = drive(server.url, NAME, prompts, 4, 2, 48, timeout_s=60, structured_share=0.5)
    assert figures["failed"] == 0, figures
    structured = figures["structured"]
    assert structured["requests"] == 4 and structured["answered"] == 4, structured
    assert structured["invalid"] == 0 and structured["valid"] + structured["cut"] == 4, structured
    assert structured["valid"] >= 1  # the compact grammar ends well within 48 tokens


@pytest.mark.parametrize("key", ["sk-from-the-shell", " "], ids=["a key", "blank"])
def test_the_loads_server_does_not_inherit_an_api_key(tiny_ov_llm_artifact, prompts, monkeypatch, key):
    """SERVE_API_KEY in the caller's environment (a key, which the clients do not send, or a blank one,
    which serve refuses at start): the load's own server runs without it."""
    from optimize.evaluate.served import served_load

    monkeypatch.setenv("SERVE_API_KEY", key)
    figures = served_load(tiny_ov_llm_artifact, prompts, clients=1, requests_per_client=1, new_tokens=2)
    assert figures["requests"] == 1 and figures["failed"] == 0, figures


def test_a_server_that_will_never_be_ready_is_one_line_at_once(tiny_ov_llm_artifact, prompts):
    """A server that exits (a flag serve refuses) or answers the readiness check with a 401 (a key
    it was given) is ServerNotReady with its reason, without waiting out the readiness timeout."""
    import sys

    from optimize.evaluate.served import ServedServer, ServerNotReady, served_load

    with pytest.raises(ServerNotReady) as exited:
        served_load(tiny_ov_llm_artifact, prompts, 1, 1, 2, flags=("--max-batch-size", "0"), ready_timeout_s=600)
    assert "exited with 2" in str(exited.value) and "max-batch-size" in str(exited.value)
    assert "\n" not in str(exited.value)
    command = [sys.executable, "-m", "serve", str(tiny_ov_llm_artifact), "--port", "0"]
    server = ServedServer("serve", command, "/v2/health/ready", env={"SERVE_API_KEY": "sk-secret"})
    try:
        with pytest.raises(ServerNotReady, match="with 401"):
            server.wait_ready(600)
        assert server.proc.poll() is None  # refused, not exited: the 4xx alone told
    finally:
        server.stop()


SIGINT_SCRIPT = """
import json, os, signal, sys

# A child inherits an ignored SIGINT from its parent (bash starts background jobs so): Ctrl-C's
# handler back, as a terminal's process has it.
signal.signal(signal.SIGINT, signal.default_int_handler)

import psutil

from optimize.evaluate import served

artifact, prompts = sys.argv[1], json.loads(sys.argv[2])
started = []
drive = served.drive


def interrupted_drive(*args, **kwargs):
    started.extend(psutil.Process().children())
    os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, once the load has begun
    return drive(*args, **kwargs)


served.drive = interrupted_drive
try:
    served.served_load(artifact, prompts, clients=2, requests_per_client=500, new_tokens=8)
    outcome = "returned"
except KeyboardInterrupt:
    outcome = "interrupted"
alive = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
print(json.dumps({"outcome": outcome, "servers": len(started), "alive": alive, "restored": restored}))
"""


def test_sigint_during_the_load_stops_it_and_the_server_then_interrupts(tiny_ov_llm_artifact, prompts):
    """SIGINT while the clients run: no client sends another request, the server is stopped, and the
    interrupt is raised as KeyboardInterrupt (asyncio would otherwise cancel the load's task, and the
    clients' error handling swallow the cancellation). In a process of its own, as a pipeline run is:
    a signal to the test runner itself would land in whatever library the earlier tests loaded."""
    import json
    import subprocess
    import sys

    from tests.support.serve import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", SIGINT_SCRIPT, str(tiny_ov_llm_artifact), json.dumps(prompts)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"outcome": "interrupted", "servers": result["servers"], "alive": [], "restored": True}
    assert result["servers"] >= 1
