"""Behaviour under load and bad input, in process: bounded queue (429 + Retry-After), per-request
timeout (504), body limit (413), bearer-token auth (401), not ready yet (503), a route the served
model's class does not answer (400)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serve.app import load_model_for
from tests.support.serve import in_process, wait_until


def slowed(delay_s: float):
    """The real model, each batch held for delay_s: makes queues and timeouts reproducible."""

    def load(state):
        model = load_model_for(state)
        run_batch = model.run_batch

        def slow(items):
            time.sleep(delay_s)
            return run_batch(items)

        model.run_batch = slow
        return model

    return load


def embed(client, name, headers=None):
    return client.post("/v1/embeddings", json={"model": name, "input": "hello"}, headers=headers)


def test_full_queue_answers_429_with_retry_after(encoder_artifact, encoder_name):
    with in_process(encoder_artifact, load_model=slowed(0.3), max_batch_size=1, max_queue=2) as client:
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: embed(client, encoder_name), range(8)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["Retry-After"] == "1" and "queue" in refused.json()["error"]["message"]


def test_request_timeout_is_504(encoder_artifact, encoder_name):
    with in_process(encoder_artifact, load_model=slowed(0.8), timeout_s=0.2) as client:
        response = embed(client, encoder_name)
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"
        kserve = client.post(
            f"/v2/models/{encoder_name}/infer",
            json={
                "inputs": [
                    {
                        "name": n,
                        "datatype": "INT64",
                        "shape": [1, 2],
                        "data": [101, 102] if n == "input_ids" else [1, 1],
                    }
                    for n in ("input_ids", "attention_mask")
                ]
                + [{"name": "token_type_ids", "datatype": "INT64", "shape": [1, 2], "data": [0, 0]}]
            },
        )
        assert kserve.status_code == 504 and isinstance(kserve.json()["error"], str)


def test_body_size_limit_is_413(encoder_artifact, encoder_name):
    with in_process(encoder_artifact, max_request_bytes=2000) as client:
        big = {"model": encoder_name, "input": "x" * 5000}
        assert client.post("/v1/embeddings", json=big).status_code == 413
        chunked = client.post("/v1/embeddings", content=iter([b'{"model": "m", "input": "', b"x" * 5000, b'"}']))
        assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "request_too_large"
        assert client.post(f"/v2/models/{encoder_name}/infer", content=b"[" * 3000).status_code == 413
        assert embed(client, encoder_name).status_code == 200


def test_api_key_guards_everything_unless_probes_are_opened(encoder_artifact, encoder_name):
    with in_process(encoder_artifact, api_key="s3cret") as client:
        missing = embed(client, encoder_name)
        assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
        assert missing.json()["error"]["type"] == "authentication_error"
        assert embed(client, encoder_name, {"Authorization": "Bearer wrong"}).status_code == 401
        assert embed(client, encoder_name, {"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/v2/health/ready").status_code == 401
        assert client.get("/metrics").status_code == 401
        assert client.get(f"/v2/models/{encoder_name}").status_code == 401
    with in_process(encoder_artifact, api_key="s3cret", open_health_metrics=True) as client:
        assert client.get("/v2/health/ready").status_code == 200
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert embed(client, encoder_name).status_code == 401


def test_api_key_from_the_environment(monkeypatch):
    from serve.config import API_KEY_ENV, resolve

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve({}, {}).api_key == "from-env"
    assert resolve({"api_key": "flag"}, {}).api_key == "flag"


def test_settings_from_the_recipe_and_the_command_line():
    from serve.config import resolve

    manifest = {"recipe": {"resolved": {"serve": {"max_batch_size": 8, "max_queue_delay_ms": 2}}}}
    assert resolve({}, manifest).max_batch_size == 8
    assert resolve({"max_batch_size": 4}, manifest).max_batch_size == 4
    assert resolve({}, manifest).max_queue_delay_ms == 2
    assert resolve({}, {}).max_batch_size == 32


def test_not_ready_until_loaded_then_ready(encoder_artifact, encoder_name):
    release = threading.Event()

    def held(state):
        release.wait(30)
        return load_model_for(state)

    with in_process(encoder_artifact, wait=False, load_model=held) as client:
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/v2/health/ready").status_code == 503
        assert client.get(f"/v2/models/{encoder_name}/ready").status_code == 503
        loading = embed(client, encoder_name)
        assert loading.status_code == 503 and loading.headers["Retry-After"]
        assert client.get(f"/v2/models/{encoder_name}").status_code == 200  # metadata from the manifest
        # What the model answers is its class's, known from the manifest: a wrong route is refused now.
        refused = client.post("/v1/completions", json={"model": encoder_name, "prompt": "hi"})
        assert refused.status_code == 400 and "/v1/embeddings" in refused.json()["error"]["message"]
        release.set()
        wait_until(lambda: client.get("/v2/health/ready").status_code == 200)
        assert embed(client, encoder_name).status_code == 200


def test_a_model_that_fails_to_load_is_never_ready(encoder_artifact, encoder_name):
    def broken(state):
        raise RuntimeError("no such provider")

    with in_process(encoder_artifact, load_model=broken) as client:
        assert client.get("/v2/health/ready").status_code == 503
        response = embed(client, encoder_name)
        assert response.status_code == 503 and "no such provider" in response.json()["error"]["message"]


ENCODER = {"format": "onnxruntime", "tokenizer": "tokenizer"}
IMAGE_MODEL = {"format": "openvino", "task": "image_classification", "inputs": [{"name": "pixels"}]}
PROTOCOLS = ("tensors", "embeddings", "predict", "completions")


@pytest.mark.parametrize(
    "engine, answered, hint",
    [
        ({**ENCODER, "task": "sentence_embedding"}, {"tensors", "embeddings"}, "an encoder (sentence embeddings)"),
        ({**ENCODER, "task": "text_classification"}, {"tensors", "predict"}, "a text classifier: use /predict"),
        ({**ENCODER, "task": "token_classification"}, {"tensors"}, "a token_classification model: use /v2/models/m"),
        (IMAGE_MODEL, {"tensors"}, "a image_classification model: use /v2/models/m/infer"),
        ({"format": "onnxruntime-genai", "task": "causal_lm"}, {"completions"}, "a causal LM: use /v1/completions"),
        ({"format": "openvino-genai", "task": "causal_lm"}, {"completions"}, "a causal LM: use /v1/completions"),
    ],
)
def test_the_served_class_decides_which_protocols_are_refused(engine, answered, hint):
    from serve.app import handler_for
    from serve.config import ServeConfig
    from serve.errors import HTTPError
    from serve.state import ServeState

    state = ServeState(Path("m"), {"engine": engine}, ServeConfig(model_name="m"), load_model_for, handler_for(engine))
    for protocol in PROTOCOLS:
        if protocol in answered:
            state.require_answers(protocol)
            continue
        with pytest.raises(HTTPError) as refusal:
            state.require_answers(protocol)
        assert refusal.value.status == 400 and refusal.value.message.startswith(f"model 'm' is {hint}")
