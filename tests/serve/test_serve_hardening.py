"""The server sheds what it refuses, and bounds hostile clients (findings 3, 4, 8, 9).

After each hostile client (a 10,000-row request, a lone surrogate, slow headers and bodies, clients that
disconnect mid-request) a normal request is answered at its usual latency.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import threading
import time

import httpx
import pytest

from serve.encoder.batching import Batcher
from serve.errors import HTTPError
from tests.support.serve import metric_value, running_server

# --- finding 3: refused and timed-out work leaves the queue -----------------------------------------


def test_a_refused_request_queues_nothing_and_a_timed_out_one_is_dropped():
    seen: list = []

    def run_batch(payloads):
        seen.extend(payloads)
        time.sleep(0.05)
        return payloads

    async def scenario():
        batcher = Batcher(run_batch, max_batch_size=1, max_queue_delay_s=0, max_queue=8)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit("first", 1, 5))
        await asyncio.sleep(0.01)  # "first" is in the runner now
        big = asyncio.ensure_future(batcher.submit_many([(f"big{i}", 1) for i in range(6)], 0.08))
        await asyncio.sleep(0)
        with pytest.raises(HTTPError) as refused:  # 6 queued + 5 > 8: all refused, none queued
            await batcher.submit_many([(f"refused{i}", 1) for i in range(5)], 5)
        assert refused.value.status == 429
        assert not any(str(p.payload).startswith("refused") for p in batcher.queue)
        with pytest.raises(HTTPError) as late:
            await big
        assert late.value.status == 504
        assert len(batcher.queue) == 0  # its queued pieces left with it
        assert await batcher.submit("after", 1, 5) == "after"
        await first
        await batcher.stop()

    asyncio.run(scenario())
    assert not any(str(p).startswith("refused") for p in seen)
    assert sum(str(p).startswith("big") for p in seen) <= 2  # at most those already running at the deadline


def test_an_abandoned_requests_pieces_are_dropped():
    seen: list = []

    def run_batch(payloads):
        seen.extend(payloads)
        time.sleep(0.05)
        return payloads

    async def scenario():
        batcher = Batcher(run_batch, max_batch_size=1, max_queue_delay_s=0, max_queue=64)
        batcher.start()
        task = asyncio.ensure_future(batcher.submit_many([(i, 1) for i in range(20)], 30))
        await asyncio.sleep(0.08)
        task.cancel()  # the client went away
        await asyncio.sleep(0)
        assert len(batcher.queue) == 0
        await batcher.stop()

    asyncio.run(scenario())
    assert len(seen) <= 4


# --- the real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(encoder_artifact):
    with running_server(encoder_artifact, "--header-timeout-s", "1", "--body-timeout-s", "2", "--max-queue", "64") as s:
        yield s


@pytest.fixture(scope="module")
def name(encoder_name):
    return encoder_name


def normal_latency(server, name, n: int = 5) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        r = httpx.post(server.url + "/v1/embeddings", json={"model": name, "input": "a normal sentence"}, timeout=30)
        assert r.status_code == 200, r.text
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@pytest.fixture(scope="module")
def baseline(server, name):
    normal_latency(server, name)  # warm up
    return normal_latency(server, name, 9)


def assert_usual(server, name, baseline):
    latency = normal_latency(server, name)
    assert latency < max(5 * baseline, baseline + 0.05), f"{latency * 1000:.0f} ms vs {baseline * 1000:.0f} ms usually"


def kserve_body(rows: int) -> bytes:
    tensors = [
        {
            "name": n,
            "datatype": "INT64",
            "shape": [rows, 4],
            "data": (
                [101, 7592, 2088, 102] if n == "input_ids" else [1, 1, 1, 1] if n == "attention_mask" else [0, 0, 0, 0]
            )
            * rows,
        }
        for n in ("input_ids", "attention_mask", "token_type_ids")
    ]
    return json.dumps({"inputs": tensors}).encode()


def test_a_10000_row_request_is_refused_before_queueing(server, name, baseline):
    started = time.perf_counter()
    r = httpx.post(
        f"{server.url}/v2/models/{name}/infer",
        content=kserve_body(10_000),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and "10000 rows" in r.json()["error"], r.text
    assert time.perf_counter() - started < 5
    assert_usual(server, name, baseline)
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": name, "input": [[101, 102]] * 3000}, timeout=60)
    assert r.status_code in (400, 413), r.text
    assert_usual(server, name, baseline)


def test_rows_over_the_queue_are_refused_whole(server, name, baseline):
    """2,048 rows of 32 are 64 pieces: a request that does not fit the queue (64) beside others is refused
    whole, and none of its pieces is computed afterwards."""
    r = httpx.post(
        f"{server.url}/v2/models/{name}/infer",
        content=kserve_body(2048),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code in (200, 429), r.text
    assert_usual(server, name, baseline)


# --- finding 4: not valid UTF-8 is 400 -----------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "NAME", "input": "\\ud800"}',
        b'{"model": "NAME", "input": ["ok", "x\\udfff"]}',
        b'{"model": "NAME", "input": "ok", "user": "\\udbff"}',
        b'{"model": "NAME", "input": "\\ud800\\ud800"}',
    ],
)
def test_lone_surrogates_are_400(server, name, baseline, body):
    r = httpx.post(
        server.url + "/v1/embeddings",
        content=body.replace(b"NAME", name.encode()),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text
    assert_usual(server, name, baseline)


def test_a_valid_surrogate_pair_is_a_character(server, name):
    body = b'{"model": "%s", "input": "smile \\ud83d\\ude00"}' % name.encode()
    r = httpx.post(server.url + "/v1/embeddings", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


# --- finding 8: slow clients -------------------------------------------------------------------------


def test_slow_headers_are_cut_off(server, name, baseline):
    socks = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    assert_usual(server, name, baseline)
    deadline = time.monotonic() + 10
    closed = 0
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            s.sendall(b"X-Trickle: 1\r\n")
            if s.recv(1) == b"":
                closed += 1
        except OSError:
            closed += 1
        finally:
            s.close()
    assert closed == len(socks), f"only {closed} of {len(socks)} slow connections were closed"
    assert_usual(server, name, baseline)


def test_a_slow_body_gets_408(server, name, baseline):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model"'
    )
    s.settimeout(10)
    started = time.monotonic()
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = s.recv(4096)
        if not chunk:
            break
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert time.monotonic() - started < 6
    assert_usual(server, name, baseline)


# --- finding 9: disconnects are not 500s -----------------------------------------------------------------


def test_client_disconnects_are_counted_as_such(server, name, baseline):
    before = httpx.get(server.url + "/metrics").text
    errors_before = metric_value(before, "serve_requests_total", status="500")
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": "'
        )
        time.sleep(0.01)
        s.close()

    # Clients that leave while their request is queued or computed.
    def leave_early():
        try:
            httpx.post(server.url + "/v1/embeddings", json={"model": name, "input": ["x " * 100] * 64}, timeout=0.01)
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=leave_early) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.0)
    after = httpx.get(server.url + "/metrics").text
    assert metric_value(after, "serve_requests_total", status="500") == errors_before
    assert metric_value(after, "serve_requests_total", status="499") >= 20
    assert "Traceback" not in server.output
    assert_usual(server, name, baseline)


def test_shutdown_line_accounts_for_disconnects(encoder_artifact, encoder_name):
    with running_server(encoder_artifact) as s:
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            time.sleep(0.01)
            sock.close()
        normal_latency(s, encoder_name, 3)
        time.sleep(0.5)
    match = re.search(
        r"answered (\d+) of (\d+) accepted requests \(0 with a server error\); (\d+) closed by their client", s.output
    )
    assert match, s.output[-2000:]
    answered, accepted, gone = map(int, match.groups())
    assert gone == 5 and answered + gone == accepted, s.output[-2000:]
    assert "Traceback" not in s.output


def test_connection_cap_is_passed_to_uvicorn():
    from serve.__main__ import build_parser

    args = build_parser().parse_args(["x", "--max-connections", "7", "--header-timeout-s", "2"])
    assert args.max_connections == 7 and args.header_timeout_s == 2.0
    from serve.config import resolve

    config = resolve(vars(args), {})
    assert config.max_connections == 7 and config.header_timeout_s == 2.0 and config.body_timeout_s == 30.0
