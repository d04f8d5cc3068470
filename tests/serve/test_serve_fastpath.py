"""The request path's shortcuts keep the answers the slow path gave: numpy arrays written straight
to JSON (orjson, or the stdlib without it), single texts tokenized with `encode`, results handed
from the runner thread straight to the callers, route labels taken from Starlette's routing."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import numpy as np
import pytest

from serve.encoder.batching import Batcher
from serve.protocols import jsonbody
from tests.support.serve import metric_value

TEXTS = ["The quick brown fox jumps over the lazy dog.", "", "héllo wörld 你好", "x " * 300, "  spaced   out  "]


@pytest.fixture(params=["orjson", "stdlib"])
def writer(request, monkeypatch):
    if request.param == "orjson":
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(jsonbody, "orjson", None)
    return request.param


def test_float32_arrays_read_back_to_the_identical_values(writer):
    vector = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    vector[:3] = [0.0, -0.0, 1e-38]
    body = jsonbody.dumps({"embedding": jsonbody.array(vector), "n": np.int64(3), "x": np.float32(0.5)})
    data = json.loads(body)
    assert np.array_equal(np.array(data["embedding"], dtype=np.float32), vector)
    assert data["n"] == 3 and data["x"] == 0.5
    assert b" " not in body  # compact


def test_other_dtypes_and_shapes_are_written_as_lists(writer):
    for value in (
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([True, False]),
        np.array([1.5, 2.25], dtype=np.float16),
        np.arange(4, dtype=">i4"),
        np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1],
    ):  # not contiguous
        assert json.loads(jsonbody.dumps(jsonbody.array(value))) == value.tolist()


def test_values_json_cannot_hold_are_refused(writer):
    with pytest.raises(ValueError):
        jsonbody.array(np.array([1.0, np.nan], dtype=np.float32))
    with pytest.raises(ValueError):
        jsonbody.array(np.array([np.inf], dtype=np.float64))


def test_float_embeddings_equal_base64_embeddings_bit_for_bit(encoder, encoder_name):
    texts = ["first text", "a second, longer text than the first"]
    floats = encoder.post("/v1/embeddings", json={"model": encoder_name, "input": texts}).json()
    packed = encoder.post(
        "/v1/embeddings", json={"model": encoder_name, "input": texts, "encoding_format": "base64"}
    ).json()
    for f, p in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4")
        assert np.array_equal(np.array(f["embedding"], dtype=np.float32), decoded)


def test_kserve_json_outputs_are_float32_exact(encoder, encoder_name):
    from tests.support.serve import kserve_tensors

    ids = [[101, 7592, 2088, 102]]
    as_json = encoder.post(f"/v2/models/{encoder_name}/infer", json={"inputs": kserve_tensors(ids)}).json()
    as_binary = encoder.post(
        f"/v2/models/{encoder_name}/infer",
        json={"inputs": kserve_tensors(ids), "parameters": {"binary_data_output": True}},
    )
    head_length = int(as_binary.headers["inference-header-content-length"])
    header = json.loads(as_binary.content[:head_length])
    offset = head_length
    for output in header["outputs"]:
        size = output["parameters"]["binary_data_size"]
        blob = np.frombuffer(as_binary.content[offset : offset + size], dtype="<f4")
        offset += size
        written = next(o for o in as_json["outputs"] if o["name"] == output["name"])
        assert np.array_equal(np.array(written["data"], dtype=np.float32), blob)


def test_one_text_tokenizes_as_a_batch_of_one_would(encoder):
    model = encoder.app.state.serve.model
    for text in TEXTS:
        alone = model.from_texts([text]).inputs
        batched = model.text([text])
        assert alone.keys() == batched.keys()
        for name in alone:
            assert alone[name].dtype == np.int64 and np.array_equal(alone[name], batched[name]), (text, name)


def test_route_label_for_a_method_the_route_does_not_take(encoder):
    assert encoder.get("/v1/embeddings").status_code == 405
    text = encoder.get("/metrics").text
    assert metric_value(text, "serve_requests_total", endpoint="/v1/embeddings", status="405") >= 1


def test_a_caller_that_goes_away_while_queued_is_never_run():
    ran = []
    gate = threading.Event()

    def model(payloads):
        gate.wait(5)
        ran.extend(payloads)
        return payloads

    async def scenario():
        batcher = Batcher(model, max_batch_size=1, max_queue_delay_s=0, max_queue=8)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit("first", 1, 5))
        await asyncio.sleep(0.05)  # the runner holds "first"
        gone = asyncio.ensure_future(batcher.submit("gone", 1, 5))
        last = asyncio.ensure_future(batcher.submit("last", 1, 5))
        await asyncio.sleep(0.01)
        gone.cancel()  # e.g. the client disconnected
        gate.set()
        results = await asyncio.gather(first, last)
        await batcher.stop()
        return results, gone.cancelled()

    results, cancelled = asyncio.run(scenario())
    assert results == ["first", "last"] and cancelled
    assert ran == ["first", "last"]


def test_results_reach_callers_while_the_next_batch_is_collected():
    """The runner thread hands each result to its caller directly; a later batch never holds it."""

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = Batcher(
            lambda payloads: [p * 2 for p in payloads], max_batch_size=4, max_queue_delay_s=0.001, max_queue=64
        )
        batcher.start()
        results = [await batcher.submit(i, 1, 5) for i in range(20)]
        results += await asyncio.gather(*(batcher.submit(i, 1, 5) for i in range(20)))
        await batcher.stop()
        assert not loop.is_closed()
        return results

    assert asyncio.run(scenario()) == [i * 2 for i in range(20)] * 2
