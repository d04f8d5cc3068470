"""A real `python -m serve` on loopback: the standard clients (tritonclient, openai), a bounded
load test that must lose nothing, and SIGTERM under load that must drop no accepted request."""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np
import pytest

from tests.support.serve import ServerProcess, kserve_tensors, metric_value, running_server

CLIENTS = 32
LOAD_SECONDS = 10


@pytest.fixture(scope="module")
def server(encoder_artifact):
    with running_server(encoder_artifact) as server:
        yield server


def test_tritonclient_http(server, encoder_name):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(encoder_name)
    assert client.get_model_metadata(encoder_name)["inputs"][0]["datatype"] == "INT64"
    assert client.get_server_metadata()["name"] == "serve"
    ids = np.array([[101, 7592, 2088, 102], [101, 2088, 102, 0]], dtype=np.int64)
    arrays = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)}
    for binary in (True, False):
        inputs = []
        for name, array in arrays.items():
            tensor = triton.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array, binary_data=binary)
            inputs.append(tensor)
        outputs = [triton.InferRequestedOutput("sentence_embedding", binary_data=binary)]
        result = client.infer(encoder_name, inputs, outputs=outputs)
        vectors = result.as_numpy("sentence_embedding")
        assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-3)
        everything = client.infer(encoder_name, inputs)  # no outputs named: all, in binary
        assert everything.as_numpy("last_hidden_state").shape == (2, 4, 384)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("nope", inputs)
    with pytest.raises(InferenceServerException, match="INT64"):
        bad = triton.InferInput("input_ids", [1, 4], "INT32")
        bad.set_data_from_numpy(ids[:1].astype(np.int32))
        client.infer(encoder_name, [bad] + inputs[1:])


def test_openai_client_embeddings(server, encoder_name):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model=encoder_name, input=["first text", "second text"])  # base64 by default
    assert [d.index for d in result.data] == [0, 1] and len(result.data[0].embedding) == 384
    floats = client.embeddings.create(model=encoder_name, input=["first text", "second text"], encoding_format="float")
    assert np.allclose(floats.data[1].embedding, result.data[1].embedding, atol=1e-5)
    assert [m.id for m in client.models.list()] == [encoder_name]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError, match="encoder"):
        client.chat.completions.create(model=encoder_name, messages=[{"role": "user", "content": "hi"}])


def client_loop(url: str, name: str, stop: threading.Event, tally: dict, lock: threading.Lock, index: int):
    """One client: alternate OpenAI and KServe requests until told to stop; count every outcome."""
    embed = {"model": name, "input": [f"client {index} says hello", "and a second, longer sentence here"]}
    infer = {"inputs": kserve_tensors([[101, 7592 + index, 2088, 102]])}
    with httpx.Client(base_url=url, timeout=30) as http:
        turn = 0
        while not stop.is_set():
            turn += 1
            path, body = ("/v1/embeddings", embed) if turn % 2 else (f"/v2/models/{name}/infer", infer)
            try:
                response = http.post(path, json=body)
                ok = response.status_code == 200 and "error" not in response.json()
                key = "ok" if ok else f"status {response.status_code}"
            except httpx.HTTPError as exc:
                key = f"{type(exc).__name__}"
            with lock:
                tally[key] = tally.get(key, 0) + 1


def run_clients(url: str, name: str, seconds: float, during=None) -> dict:
    stop, lock, tally = threading.Event(), threading.Lock(), {}
    threads = [threading.Thread(target=client_loop, args=(url, name, stop, tally, lock, i)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    if during:
        during()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    return tally


def test_load_32_clients_lose_nothing(server, encoder_name):
    before = httpx.get(server.url + "/metrics").text
    tally = run_clients(server.url, encoder_name, LOAD_SECONDS)
    time.sleep(0.3)  # let the last requests' accounting finish before reading the counters
    after = httpx.get(server.url + "/metrics").text
    assert set(tally) == {"ok"}, tally
    answered = sum(
        metric_value(after, "serve_requests_total", endpoint=e, status="200")
        - metric_value(before, "serve_requests_total", endpoint=e, status="200")
        for e in ("/v1/embeddings", "/v2/models/{name}/infer")
    )
    assert answered == tally["ok"]  # every request the clients sent was answered, and only those
    batches = metric_value(after, "serve_batch_size_count") - metric_value(before, "serve_batch_size_count")
    rows = metric_value(after, "serve_batch_size_sum") - metric_value(before, "serve_batch_size_sum")
    assert rows / batches > 2  # concurrent requests were batched together
    assert metric_value(after, "serve_queue_depth") == 0


def test_sigterm_under_load_drains_every_accepted_request(encoder_artifact, encoder_name):
    server = ServerProcess(encoder_artifact).wait_ready()
    probes = server_probe_count(server)
    codes: list[int] = []

    def terminate_soon():
        time.sleep(3)
        codes.append(server.terminate())

    stopper = threading.Thread(target=terminate_soon)
    tally = run_clients(server.url, encoder_name, 0, during=lambda: (stopper.start(), stopper.join()))
    assert codes == [0], server.output
    match = re.search(r"answered (\d+) of (\d+) accepted requests", server.output)
    assert match, server.output
    answered, accepted = int(match.group(1)), int(match.group(2))
    assert answered == accepted  # nothing accepted was dropped
    assert tally.get("ok", 0) + probes == answered, tally  # and every answer reached its client
    assert tally.get("ok", 0) > 0
    refused = set(tally) - {"ok"}  # after the listener closed: connections refused or closed unread
    assert refused <= {"ConnectError", "RemoteProtocolError", "ReadError"}, tally


def server_probe_count(server: ServerProcess) -> int:
    """Requests the server has answered so far (the readiness probes), read from its metrics."""
    text = httpx.get(server.url + "/metrics").text
    return int(metric_value(text, "serve_requests_total")) + 1  # + this /metrics request itself
