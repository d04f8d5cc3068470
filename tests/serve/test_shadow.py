"""`python -m serve ARTIFACT --shadow CANDIDATE` on loopback with the real encoder artifact: the
candidate's answers compared by the gate's measures, in /metrics and in a report that
`optimize.reports.compare` reads; a candidate that hangs (SIGSTOP) or dies (SIGKILL) leaves every
user request answered; bad shadow settings are refused with one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from serve.shadow.traffic import cosine_rows, texts_of, token_agreement
from tests.support.cli import one_error_line
from tests.support.serve import ROOT, ServerProcess, metric_value, wait_until

TEXTS = ["a first sentence", "the second one, longer than the first", "three"]


def test_measures_are_the_gates():
    """The shadow's cosine is the pipeline's own function (optimize/evaluate/fidelity.py), empty rows included."""
    from optimize.evaluate.fidelity import cosine_rows as gate_cosine

    assert cosine_rows is gate_cosine
    a = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    b = np.array([[2.0, 0.0], [1.0, -1.0], [1e-9, 0.0]])
    np.testing.assert_allclose(cosine_rows(a, b), [1.0, 0.0, 1.0], atol=1e-12)
    assert token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)
    assert token_agreement([1, 2], [1, 2, 3]) == (2 / 3, 2)
    assert token_agreement([5], [5]) == (1.0, None)


def test_streamed_and_whole_completions_read_the_same():
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("Hel", "lo", "")]
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    assert texts_of({"content-type": "text/event-stream"}, stream.encode()) == ["Hello"]
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}}]}
    assert texts_of({"content-type": "application/json"}, json.dumps(chat).encode()) == ["Hello"]


def embed(url: str, name: str) -> int:
    body = {"model": name, "input": TEXTS}
    return httpx.post(url + "/v1/embeddings", json=body, timeout=60).status_code


def burst(url: str, name: str, n: int) -> list[int]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: embed(url, name), range(n)))


def shadow_metric(url: str, outcome: str) -> float:
    return metric_value(httpx.get(url + "/metrics").text, "serve_shadow_requests_total", outcome=outcome)


def candidate_pid(server: ServerProcess) -> int:
    found = wait_until(lambda: re.search(r"shadow candidate .* \(pid (\d+)\)", server.output))
    return int(found.group(1))


@pytest.mark.slow
def test_shadow_compares_and_a_failing_candidate_never_fails_a_request(encoder_artifact, encoder_name, tmp_path):
    report = tmp_path / "report"
    args = ["--shadow", str(encoder_artifact), "--shadow-report", str(report), "--shadow-queue", "4"]
    args += ["--shadow-timeout-s", "2", "--threads", "1"]
    server = ServerProcess(encoder_artifact, *args).wait_ready(timeout=120)
    try:
        pid = candidate_pid(server)
        wait_until(lambda: "shadow candidate ready" in server.output, timeout=120)
        assert burst(server.url, encoder_name, 12) == [200] * 12
        wait_until(lambda: shadow_metric(server.url, "compared") >= 1)
        metrics = httpx.get(server.url + "/metrics").text
        # The candidate is the same artifact: every embedding row agrees.
        assert metric_value(metrics, "serve_shadow_cosine_bucket", le="0.9999") == 0
        assert metric_value(metrics, "serve_shadow_cosine_count") >= len(TEXTS)
        assert metric_value(metrics, "serve_shadow_latency_seconds_count", side="candidate") >= 1

        os.kill(pid, signal.SIGSTOP)  # hangs: the shadow's requests time out, its queue fills
        assert burst(server.url, encoder_name, 24) == [200] * 24
        wait_until(lambda: shadow_metric(server.url, "dropped") + shadow_metric(server.url, "failed") >= 1)

        os.kill(pid, signal.SIGKILL)  # dies: connections refused from now on
        failed = shadow_metric(server.url, "failed")
        assert burst(server.url, encoder_name, 12) == [200] * 12
        wait_until(lambda: shadow_metric(server.url, "failed") > failed, timeout=30)
    finally:
        assert server.terminate() == 0, server.output

    summary = json.loads((report / "shadow.json").read_text())
    assert summary["figures"]["cosine_min"] > 0.9999 and summary["figures"]["rows"] >= len(TEXTS)
    assert summary["requests"]["compared"] >= 1 and summary["latency_ms"]["artifact"]["p50"] > 0
    out = tmp_path / "compare"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.reports.compare", str(report), str(encoder_artifact), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = (out / "compare.csv").read_text().splitlines()
    assert "cosine_min" in rows[0] and any(",shadow," in row for row in rows[1:])


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--shadow", "/no/such/candidate"], "is not a directory"),
        (["--shadow", "https://10.0.0.7:8000"], "http:// URL"),
        (["--shadow", "/tmp", "--shadow-queue", "0"], "--shadow-queue"),
    ],
)
@pytest.mark.slow
def test_bad_shadow_settings_are_refused(encoder_artifact, args, fragment):
    proc = subprocess.run(
        [sys.executable, "-m", "serve", str(encoder_artifact), "--port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(proc, fragment, log_lines=True)


@pytest.mark.slow
def test_a_shadowed_lm_is_compared_token_by_token(tiny_llm_artifact, tmp_path):
    """Greedy completions, whole and streamed, from the same LM on both sides: every token agrees."""
    report = tmp_path / "report"
    args = ["--shadow", str(tiny_llm_artifact), "--shadow-report", str(report), "--max-tokens", "16"]
    server = ServerProcess(tiny_llm_artifact, *args).wait_ready(timeout=120)
    try:
        wait_until(lambda: "shadow candidate ready" in server.output, timeout=120)
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        for stream in (False, True, False):
            body = {"model": name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": stream}
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        wait_until(lambda: shadow_metric(server.url, "compared") >= 3)
    finally:
        assert server.terminate() == 0, server.output
    figures = json.loads((report / "shadow.json").read_text())["figures"]
    assert figures["generations"] == 3 and figures["token_agreement"] == 1.0 and figures["exact_match"] == 1.0
