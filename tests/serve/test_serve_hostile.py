"""Hostile input against real servers on loopback (`python -m serve` subprocesses, real artifacts):
shapes numpy cannot hold, integers Python will not read, raw-encoded surrogates, seeds the engine
cannot take, tensor requests larger than one batch, and how each request is counted by how it
ended (answers with a server error, streams closed by their client, streams longer than the
request-body deadline)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from tests.support.serve import metric_value, running_server

LLM = "tiny_llm"
LONG_INT = b"1" * 4301  # past Python's 4300-digit limit on int(), where json.loads raises ValueError
RAW_SURROGATE = b"\xed\xa0\x80"  # U+D800 encoded as if it were a character: not UTF-8


def post(server, path: str, body: bytes, **headers) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json", **headers})


def model_name(artifact) -> str:
    from engines.artifact import read_manifest

    return read_manifest(artifact)["recipe"]["name"]


@pytest.fixture(scope="module")
def encoder_server(encoder_artifact):
    with running_server(encoder_artifact) as server:
        yield server


@pytest.fixture(scope="module")
def tensor_server(tensor_artifact):
    with running_server(tensor_artifact, "--max-batch-size", "32") as server:
        yield server


@pytest.fixture(scope="module")
def llm_server(tiny_llm_artifact):
    with running_server(tiny_llm_artifact) as server:
        yield server


def assert_clean_refusal(response: httpx.Response, status=(400,), words=()) -> str:
    assert response.status_code in status, response.text
    body = response.json()["error"]
    message = body if isinstance(body, str) else body["message"]
    assert message and "\n" not in message
    for word in words:
        assert word in message, message
    return message


# --- shapes with a zero dim beside a huge one -------------------------------------------------------


def shape_body(name: str, shape: list[int], datatype: str, binary: bool) -> tuple[bytes, dict]:
    tensor: dict = {"name": name, "datatype": datatype, "shape": shape}
    if binary:
        tensor["parameters"] = {"binary_data_size": 0}
        header = json.dumps({"inputs": [tensor]}).encode()
        return header, {"Inference-Header-Content-Length": str(len(header))}
    tensor["data"] = []
    return json.dumps({"inputs": [tensor]}).encode(), {}


@pytest.mark.parametrize("shape", [[2**63, 0], [2**62, 0], [0, 2**62, 2], [2**31, 2**31, 0]])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_huge_dims_beside_a_zero_are_refused(
    encoder_server, tensor_server, encoder_name, tensor_artifact, shape, binary
):
    for server, name, tensor, datatype in (
        (encoder_server, encoder_name, "input_ids", "INT64"),
        (tensor_server, model_name(tensor_artifact), "x", "FP32"),
    ):
        body, headers = shape_body(tensor, shape, datatype, binary)
        response = post(server, f"/v2/models/{name}/infer", body, **headers)
        assert_clean_refusal(response, (400, 422), ["'shape'"])
    for server in (encoder_server, tensor_server):
        assert "Traceback" not in server.output


# --- integers past 4300 digits, raw surrogate bytes ---------------------------------------------------


def route_bodies(encoder_name: str) -> list[tuple[str, str, bytes]]:
    """(server, path, body template with VALUE where the hostile bytes go) for every JSON route."""
    return [
        ("encoder", "/v1/embeddings", b'{"model": "%s", "input": "VALUE"}' % encoder_name.encode()),
        ("encoder", f"/v2/models/{encoder_name}/infer", b'{"inputs": [], "id": "VALUE"}'),
        ("llm", "/v1/completions", b'{"model": "tiny_llm", "prompt": "VALUE", "max_tokens": 2}'),
        (
            "llm",
            "/v1/chat/completions",
            b'{"model": "tiny_llm", "messages": [{"role": "user", "content": "VALUE"}], "max_tokens": 2}',
        ),
    ]


def test_integers_past_4300_digits_are_400_on_every_route(encoder_server, llm_server, encoder_name):
    servers = {"encoder": encoder_server, "llm": llm_server}
    for which, path, template in route_bodies(encoder_name):
        body = template.replace(b'"VALUE"', LONG_INT)
        assert_clean_refusal(post(servers[which], path, body), words=["integer", "64 digits"])
    # Within the limit an integer is read as usual, and refused (or used) by the field's own rule.
    body = b'{"model": "tiny_llm", "prompt": "x", "max_tokens": %s}' % (b"9" * 64)
    assert_clean_refusal(post(llm_server, "/v1/completions", body), words=["max_tokens"])
    for server in servers.values():
        assert "Traceback" not in server.output


def test_raw_encoded_surrogates_are_400_on_every_route(encoder_server, llm_server, encoder_name):
    servers = {"encoder": encoder_server, "llm": llm_server}
    for which, path, template in route_bodies(encoder_name):
        body = template.replace(b"VALUE", b"ok " + RAW_SURROGATE)
        assert_clean_refusal(post(servers[which], path, body), words=["UTF-8"])
    # Real UTF-8 (a four-byte character) still goes through.
    body = route_bodies(encoder_name)[0][2].replace(b"VALUE", "smile \U0001f600".encode())
    assert post(encoder_server, "/v1/embeddings", body).status_code == 200
    for server in servers.values():
        assert "Traceback" not in server.output


# --- seeds --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**70, 2**31, -1])
def test_seeds_the_engine_cannot_take_are_400(llm_server, seed):
    for path, extra in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        body = {"model": LLM, "max_tokens": 4, "temperature": 1.0, "seed": seed, **extra}
        r = httpx.post(llm_server.url + path, json=body)
        assert_clean_refusal(r, words=["'seed'", str(seed)])
    ok = httpx.post(
        llm_server.url + "/v1/completions",
        json={"model": LLM, "prompt": "x", "max_tokens": 4, "temperature": 1.0, "seed": 2**31 - 1},
    )
    assert ok.status_code == 200, ok.text
    assert "Traceback" not in llm_server.output


# --- tensor requests larger than one batch ----------------------------------------------------------


def test_tensor_rows_past_the_batch_size_are_split_and_match_the_offline_answer(tensor_server, tensor_artifact):
    from engines import load

    name = model_name(tensor_artifact)
    x = np.random.default_rng(0).normal(size=(33, 4)).astype(np.float32)
    expected = load(tensor_artifact, threads=1)({"x": x})["y"]
    batches_before = metric_value(httpx.get(tensor_server.url + "/metrics").text, "serve_batch_size_count")
    for binary in (False, True):
        if binary:
            header = json.dumps(
                {
                    "inputs": [
                        {
                            "name": "x",
                            "datatype": "FP32",
                            "shape": [33, 4],
                            "parameters": {"binary_data_size": x.nbytes},
                        }
                    ]
                }
            ).encode()
            r = post(
                tensor_server,
                f"/v2/models/{name}/infer",
                header + x.tobytes(),
                **{"Inference-Header-Content-Length": str(len(header))},
            )
        else:
            r = httpx.post(
                tensor_server.url + f"/v2/models/{name}/infer",
                json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [33, 4], "data": x.ravel().tolist()}]},
            )
        assert r.status_code == 200, r.text
        (output,) = r.json()["outputs"]
        assert output["shape"] == [33, 3]
        np.testing.assert_array_equal(np.array(output["data"], np.float32).reshape(33, 3), expected)
    batches = metric_value(httpx.get(tensor_server.url + "/metrics").text, "serve_batch_size_count") - batches_before
    assert batches == 4  # each request ran as 32 rows + 1 row
    assert "Traceback" not in tensor_server.output


# --- the drain line counts answers by how they ended --------------------------------------------------


def drain_counts(output: str) -> tuple[int, ...]:
    match = re.search(
        r"answered (\d+) of (\d+) accepted requests \((\d+) with a server error\); (\d+) closed by their client "
        r"before the answer; (\d+) cut off by a server error",
        output,
    )
    assert match, output[-3000:]
    return tuple(map(int, match.groups()))


def test_answers_with_a_server_error_are_counted_as_answered(tensor_artifact):
    name = model_name(tensor_artifact)
    finite = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    # Finite inputs whose product overflows float32: the model answers infinity, which JSON cannot
    # write; that is the server's failure (500), and the request was still answered.
    overflow = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [3e38] * 4}]}
    with running_server(tensor_artifact) as server:
        codes = [
            httpx.post(server.url + f"/v2/models/{name}/infer", json=body).status_code
            for body in (finite, overflow, finite, overflow)
        ]
        assert codes == [200, 500, 200, 500]
        metrics = httpx.get(server.url + "/metrics").text
        assert metric_value(metrics, "serve_requests_total", endpoint="/v2/models/{name}/infer", status="500") == 2
    answered, accepted, errors, gone, cut = drain_counts(server.output)
    assert (answered, errors, gone, cut) == (accepted, 2, 0, 0), server.output[-3000:]


# --- streams: counted by how they ended, never cut by the body deadline ---------------------------------


def stream_request(path: str, body: dict) -> bytes:
    """One buffer, headers and body together: the body is in as soon as the headers are."""
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + payload


def leave_after_first_token(port: int, path: str, body: dict) -> None:
    """Read until the first generated piece arrives, then close the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(stream_request(path, body))
        received = b""
        while received.count(b"data: ") < (3 if "chat" in path else 2):  # chat: a role chunk comes first
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")


def test_streams_closed_by_their_client_are_499_everywhere(tiny_llm_artifact):
    long = {"model": LLM, "max_tokens": 200, "temperature": 0, "stream": True}  # 2 s at 10 ms a token
    requests = [
        ("/v1/completions", {**long, "prompt": "def main():"}),
        ("/v1/chat/completions", {**long, "messages": [{"role": "user", "content": "What is Python?"}]}),
    ] * 2
    with running_server(tiny_llm_artifact, "--log-level", "debug", token_delay_s=0.01) as server:
        for path, body in requests:
            leave_after_first_token(server.port, path, body)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = httpx.get(server.url + "/metrics").text
            if metric_value(metrics, "serve_requests_total", status="499") >= len(requests):
                break
            time.sleep(0.1)
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            assert metric_value(metrics, "serve_requests_total", endpoint=endpoint, status="499") == 2, metrics
            assert metric_value(metrics, "serve_requests_total", endpoint=endpoint, status="200") == 0, metrics
    access = [line for line in server.lines if re.search(r"POST /v1/(chat/)?completions 499 disconnected", line)]
    assert len(access) == len(requests), server.output[-3000:]
    answered, accepted, errors, gone, cut = drain_counts(server.output)
    assert gone == len(requests) and answered + gone == accepted and errors == cut == 0, server.output[-3000:]


def read_stream(port: int, path: str, body: dict, out: list) -> None:
    """(status line, the stream's `data:` lines, seconds from sending the request to its end)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(stream_request(path, body))
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, chunked = received.partition(b"\r\n\r\n")
    lines = [line for line in dechunk(chunked).decode().split("\n") if line.startswith("data: ")]
    out.append((head.split(b"\r\n")[0].decode(), lines, time.monotonic() - started))


def dechunk(data: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    body = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, data = body + data[:size], data[size + 2 :]
    return body


def test_streams_outlast_the_request_body_deadline(tiny_llm_artifact):
    """Four concurrent streams of 100 tokens, 10 ms apart: each runs for a second, and generations
    run one at a time, so the last one ends about 4 s after it arrived; the request-body deadline
    is 0.5 s, and every stream must still run to its end and close with [DONE]."""
    body = {"model": LLM, "prompt": "def main():", "max_tokens": 100, "temperature": 0, "stream": True}
    url = "/v1/completions"
    with running_server(tiny_llm_artifact, "--body-timeout-s", "0.5", token_delay_s=0.01) as server:
        results: list = []
        threads = [threading.Thread(target=read_stream, args=(server.port, url, body, results)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 4
        assert min(seconds for _, _, seconds in results) > 0.9  # every stream outlasted the deadline
        for status, lines, _ in results:
            assert status == "HTTP/1.1 200 OK" and lines[-1] == "data: [DONE]", (status, lines[-3:])
            events = [json.loads(line[6:]) for line in lines[:-1]]
            assert not any("error" in e for e in events), events[-2:]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(server.url + "/metrics").text
        assert metric_value(metrics, "serve_requests_total", endpoint=url, status="200") == 4
    answered, accepted, errors, gone, cut = drain_counts(server.output)
    assert answered == accepted and errors == gone == cut == 0, server.output[-3000:]
