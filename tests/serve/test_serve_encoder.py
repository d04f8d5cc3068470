"""Every encoder endpoint in process (Starlette's TestClient runs the same ASGI app, lifespan
included): health, metadata, KServe inference in JSON and binary, OpenAI embeddings, and the
error codes for bad input, each with a JSON body."""

from __future__ import annotations

import base64
import gzip
import json

import numpy as np
import pytest

from tests.support.serve import kserve_tensors, metric_value

IDS = [[101, 7592, 2088, 102]]


def infer_url(name: str) -> str:
    return f"/v2/models/{name}/infer"


def embedding_of(client, name, text):
    body = client.post("/v1/embeddings", json={"model": name, "input": text}).json()
    return np.array(body["data"][0]["embedding"], dtype=np.float32)


def test_health_and_server_metadata(encoder):
    assert encoder.get("/v2/health/live").status_code == 200
    assert encoder.get("/v2/health/ready").status_code == 200
    meta = encoder.get("/v2").json()
    assert meta["name"] == "serve" and "binary_tensor_data" in meta["extensions"]


def test_model_metadata_comes_from_the_manifest_and_graph(encoder, encoder_name, encoder_artifact):
    from engines.artifact import read_manifest

    meta = encoder.get(f"/v2/models/{encoder_name}").json()
    assert meta["name"] == encoder_name and meta["platform"] == "onnxruntime_onnx"
    assert [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(i["datatype"] == "INT64" and i["shape"] == [-1, -1] for i in meta["inputs"])
    assert {o["name"] for o in meta["outputs"]} == {"last_hidden_state", "sentence_embedding"}
    assert meta["artifact"]["id"] == read_manifest(encoder_artifact)["id"]
    assert encoder.get(f"/v2/models/{encoder_name}/versions/1").json() == meta
    assert encoder.get(f"/v2/models/{encoder_name}/ready").status_code == 200
    assert encoder.get(f"/v2/models/{encoder_name}/config").json()["max_batch_size"] == 32


def test_infer_json_tensors(encoder, encoder_name):
    response = encoder.post(infer_url(encoder_name), json={"id": "req-1", "inputs": kserve_tensors(IDS)})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "req-1" and body["model_name"] == encoder_name
    outputs = {o["name"]: o for o in body["outputs"]}
    assert outputs["sentence_embedding"]["shape"] == [1, 384]
    assert outputs["last_hidden_state"]["shape"] == [1, 4, 384]
    vector = np.array(outputs["sentence_embedding"]["data"])
    assert abs(np.linalg.norm(vector) - 1) < 1e-3  # the graph L2-normalises


def test_infer_matches_embeddings_endpoint(encoder, encoder_name, encoder_artifact):
    from engines.text import TextEncoder

    text = "Serving what was measured."
    ids = TextEncoder(encoder_artifact / "tokenizer")([text])["input_ids"]
    body = encoder.post(
        infer_url(encoder_name), json={"inputs": kserve_tensors(ids), "outputs": [{"name": "sentence_embedding"}]}
    ).json()
    assert [o["name"] for o in body["outputs"]] == ["sentence_embedding"]
    via_kserve = np.array(body["outputs"][0]["data"], dtype=np.float32)
    np.testing.assert_allclose(via_kserve, embedding_of(encoder, encoder_name, text), atol=1e-5)


def test_infer_binary_extension_both_ways(encoder, encoder_name):
    ids = np.array(IDS, dtype=np.int64)
    arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    blobs = [a.tobytes() for a in arrays.values()]
    header = json.dumps(
        {
            "inputs": [
                {"name": n, "datatype": "INT64", "shape": list(a.shape), "parameters": {"binary_data_size": len(b)}}
                for (n, a), b in zip(arrays.items(), blobs)
            ],
            "outputs": [{"name": "sentence_embedding", "parameters": {"binary_data": True}}],
        }
    ).encode()
    response = encoder.post(
        infer_url(encoder_name),
        content=header + b"".join(blobs),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    meta = json.loads(response.content[:length])
    vector = np.frombuffer(response.content[length:], dtype="<f4")
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == vector.nbytes == 384 * 4
    json_body = encoder.post(infer_url(encoder_name), json={"inputs": kserve_tensors(IDS)}).json()
    expected = next(o for o in json_body["outputs"] if o["name"] == "sentence_embedding")["data"]
    np.testing.assert_allclose(vector, expected, atol=1e-6)


def test_gzip_request_body(encoder, encoder_name):
    body = gzip.compress(json.dumps({"inputs": kserve_tensors(IDS)}).encode())
    response = encoder.post(infer_url(encoder_name), content=body, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200


def gate_min_cosine(artifact) -> float:
    """The fidelity floor the artifact was gated on (its min_cosine check), 0.99 if it has none."""
    from engines.artifact import read_manifest

    checks = (read_manifest(artifact).get("gate") or {}).get("checks", [])
    return next((c["threshold"] for c in checks if c.get("name") == "min_cosine"), 0.99)


def test_padding_in_a_batch_does_not_change_results(encoder, encoder_name, encoder_artifact):
    """Rows of different lengths in one request are padded together; each matches its lone run.

    Not bit-exact: dynamic INT8 quantization picks activation scales per call, over the whole
    batch (padding included), so batch-mates shift each other (cosine 0.978-0.995 measured,
    depending on how many layers the recipe kept in FP32). The bound is the artifact's own gate."""
    short, long = "Short one.", "A much longer sentence, with several more tokens than the other."
    together = encoder.post("/v1/embeddings", json={"model": encoder_name, "input": [short, long]}).json()
    for i, text in enumerate((short, long)):
        alone = embedding_of(encoder, encoder_name, text)
        assert float(np.dot(alone, together["data"][i]["embedding"])) >= gate_min_cosine(encoder_artifact)


def test_embeddings_float_base64_and_tokens(encoder, encoder_name):
    floats = encoder.post("/v1/embeddings", json={"model": encoder_name, "input": ["a", "b", "c"]}).json()
    assert floats["object"] == "list" and [d["index"] for d in floats["data"]] == [0, 1, 2]
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 0
    packed = encoder.post(
        "/v1/embeddings", json={"model": encoder_name, "input": ["a", "b", "c"], "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][1]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats["data"][1]["embedding"], atol=1e-6)
    tokens = encoder.post("/v1/embeddings", json={"model": encoder_name, "input": [[101, 1037, 102]]})
    assert tokens.status_code == 200 and len(tokens.json()["data"][0]["embedding"]) == 384


def test_more_inputs_than_one_batch_are_split_and_kept_in_order(encoder, encoder_name, encoder_artifact):
    texts = [f"sentence number {i}" for i in range(70)]  # max batch size is 32
    data = encoder.post("/v1/embeddings", json={"model": encoder_name, "input": texts}).json()["data"]
    assert [d["index"] for d in data] == list(range(70))
    alone = embedding_of(encoder, encoder_name, texts[65])
    assert float(np.dot(data[65]["embedding"], alone)) >= gate_min_cosine(encoder_artifact)


def test_models_list(encoder, encoder_name):
    models = encoder.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [encoder_name]
    assert encoder.get(f"/v1/models/{encoder_name}").json()["id"] == encoder_name
    assert encoder.get("/v1/models/nope").status_code == 404


def kserve_error(response, status):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert isinstance(response.json()["error"], str) and response.json()["error"]


def openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    return error


@pytest.mark.parametrize(
    "body, status",
    [
        (b"{not json", 400),
        (b"[]", 400),
        (b'{"inputs": []}', 400),
        (b'{"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1]}]}', 422),
    ],
)
def test_infer_malformed_bodies(encoder, encoder_name, body, status):
    kserve_error(encoder.post(infer_url(encoder_name), content=body), status)


def test_infer_wrong_dtype_shape_names_and_ranges(encoder, encoder_name):
    good = kserve_tensors(IDS)
    wrong_dtype = [dict(t, datatype="FP32") for t in good]
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": wrong_dtype}), 422)
    wrong_shape = [dict(t, shape=[4]) for t in good]
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": wrong_shape}), 422)
    three_d = [dict(t, shape=[1, 2, 2]) for t in good]
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": three_d}), 422)
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": good[:2]}), 422)
    renamed = good[:2] + [dict(good[2], name="segment_ids")]
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": renamed}), 422)
    out_of_vocab = [dict(good[0], data=[101, 10**6, 5, 102])] + good[1:]
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": out_of_vocab}), 422)
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": good, "outputs": [{"name": "logits"}]}), 422)
    too_long = kserve_tensors([[101] * 600])
    kserve_error(encoder.post(infer_url(encoder_name), json={"inputs": too_long}), 422)


def test_unknown_model_and_version_are_404(encoder, encoder_name):
    kserve_error(encoder.post(infer_url("nope"), json={"inputs": kserve_tensors(IDS)}), 404)
    kserve_error(encoder.post(f"/v2/models/{encoder_name}/versions/7/infer", json={"inputs": kserve_tensors(IDS)}), 404)
    kserve_error(encoder.get("/v2/models/nope"), 404)
    error = openai_error(encoder.post("/v1/embeddings", json={"model": "nope", "input": "x"}), 404)
    assert error["param"] == "model"
    openai_error(encoder.get("/v1/no-such-route"), 404)


def test_embeddings_bad_requests(encoder, encoder_name):
    post = lambda body: encoder.post("/v1/embeddings", json=body)  # noqa: E731
    openai_error(post({"input": "x"}), 400)  # no model
    openai_error(post({"model": encoder_name}), 400)  # no input
    openai_error(post({"model": encoder_name, "input": []}), 400)
    openai_error(post({"model": encoder_name, "input": [1, "a"]}), 400)
    openai_error(post({"model": encoder_name, "input": "x", "encoding_format": "int8"}), 400)
    openai_error(post({"model": encoder_name, "input": "x", "dimensions": 10}), 400)
    openai_error(post({"model": encoder_name, "input": [[5, 10**7]]}), 422)
    openai_error(encoder.post("/v1/embeddings", content=b"{"), 400)


def test_llm_and_classifier_endpoints_on_an_encoder_explain_why(encoder, encoder_name):
    """The encoder's class answers tensors and embeddings only; every other route names /v1/embeddings."""
    for path, body in (
        ("/v1/completions", {"model": encoder_name, "prompt": "hi"}),
        ("/v1/chat/completions", {"model": encoder_name, "messages": [{"role": "user", "content": "hi"}]}),
        ("/predict", {"inputs": "hi"}),
    ):
        error = openai_error(encoder.post(path, json=body), 400)
        assert "encoder" in error["message"] and "/v1/embeddings" in error["message"]


def test_metrics_count_requests_by_endpoint_and_status(encoder, encoder_name):
    encoder.post("/v1/embeddings", json={"model": encoder_name, "input": "count me"})
    encoder.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    text = encoder.get("/metrics").text
    assert metric_value(text, "serve_requests_total", endpoint="/v1/embeddings", status="200") >= 1
    assert metric_value(text, "serve_requests_total", endpoint="/v1/embeddings", status="404") >= 1
    assert metric_value(text, "serve_request_duration_seconds_count", endpoint="/v1/embeddings") >= 2
    assert metric_value(text, "serve_batch_size_count") >= 1
    assert "serve_queue_depth" in text and "serve_time_to_first_token_seconds" in text
    assert metric_value(text, "serve_model_ready") == 1
