"""Classifier artifacts served by a real `python -m serve` on loopback: /predict as Text Embeddings
Inference answers it (httpx), KServe v2 logits through tritonclient, both the pipeline's numbers;
a token classifier's per-token logits on KServe v2 and its refusal on /predict."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support import tiny_classifiers
from tests.support.cli import run_optimize
from tests.support.serve import running_server

pytest.importorskip("seqeval")


def build(tmp_path_factory, name: str, model: Path, data: Path, *extra: str) -> Path:
    out = tmp_path_factory.mktemp(name) / "artifact"
    proc = run_optimize(
        f"model.source={model}",
        "engine=onnx",
        "quantize=ort_int8_dynamic",
        "quantize.params.fallback_min_cosine=null",
        "evaluate.data.source=labeled",
        f"evaluate.data.path={data}",
        "evaluate.data.min_chars=1",
        "calibration.count=8",
        "evaluate.latency=false",
        "evaluate.memory=false",
        "gate=none",
        "gate.max_f1_drop=10",
        f"output_dir={out}",
        f"hydra.run.dir={out.parent / 'run'}",
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def text_artifact(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text_model")
    model = tiny_classifiers.tiny_text_classifier(folder / "model")
    data = tiny_classifiers.write_jsonl(tiny_classifiers.topic_examples(), folder / "topics.jsonl")
    return build(
        tmp_path_factory,
        "text",
        model,
        data,
        "model.task=text_classification",
        "evaluate.data.count=32",
        "calibration.source=labeled",  # the other split of the same file: never the evaluation's texts
        f"calibration.path={data}",
        "calibration.min_chars=1",
    )


@pytest.fixture(scope="module")
def text_server(text_artifact):
    with running_server(text_artifact) as server:
        yield server


def artifact_logits(artifact: Path, texts: list[str]) -> np.ndarray:
    """The artifact's own graph on the artifact's own tokenizer, as the pipeline measured it."""
    from engines import load_engine
    from engines.text import TextEncoder

    engine = json.loads((artifact / "manifest.json").read_text())["engine"]
    runner = load_engine(artifact, engine)
    return runner(TextEncoder(artifact / "tokenizer", engine["max_length"])(texts))["logits"]


TEXTS = [
    "The while statement is used for repeated execution as long as an expression is true.",
    "Special method names: a class can implement operations invoked by special syntax.",
]


def test_predict_answers_like_text_embeddings_inference(text_server, text_artifact):
    single = httpx.post(text_server.url + "/predict", json={"inputs": TEXTS[0]}, timeout=30)
    assert single.status_code == 200
    predictions = single.json()  # one text: a list of {label, score}, highest first
    assert [p["label"] for p in predictions][0] in tiny_classifiers.TOPIC_LABELS
    assert sorted(p["label"] for p in predictions) == sorted(tiny_classifiers.TOPIC_LABELS)
    assert sum(p["score"] for p in predictions) == pytest.approx(1.0, abs=1e-6)
    assert predictions[0]["score"] >= predictions[1]["score"]
    batch = httpx.post(text_server.url + "/predict", json={"inputs": TEXTS}, timeout=30).json()
    assert len(batch) == 2 and all(len(row) == 2 for row in batch)  # a list in: a list of lists out
    logits = artifact_logits(text_artifact, TEXTS)
    labels = json.loads((text_artifact / "labels.json").read_text())["id2label"]
    assert [row[0]["label"] for row in batch] == [labels[str(i)] for i in logits.argmax(-1)]
    raw = httpx.post(text_server.url + "/predict", json={"inputs": TEXTS, "raw_scores": True}, timeout=30).json()
    got = {p["label"]: p["score"] for p in raw[1]}
    assert [got[labels[str(i)]] for i in range(2)] == pytest.approx(logits[1].tolist(), abs=1e-4)


def test_predict_refuses_what_tei_refuses(text_server):
    url = text_server.url + "/predict"
    long_text = "word " * 400
    too_long = httpx.post(url, json={"inputs": long_text}, timeout=30)
    assert too_long.status_code == 422 and "truncate" in too_long.json()["error"]["message"]
    assert httpx.post(url, json={"inputs": long_text, "truncate": True}, timeout=30).status_code == 200
    for body in ({"inputs": []}, {"inputs": 3}, {"text": "x"}, {"inputs": "x", "raw_scores": "yes"}):
        assert httpx.post(url, json=body, timeout=30).status_code == 400, body
    hostile = (
        b"\xff\xfe{}",  # not UTF-8
        b'{"inputs": "\\ud800"}',  # a lone surrogate
        b'{"inputs": ' + b"9" * 5000 + b"}",  # an integer of 5,000 digits
        b'{"inputs": ["a", 1]}',
        b'{"inputs": [["a"]]}',
        b"[]",
        b"",
    )
    for raw in hostile:
        reply = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["message"], raw[:40]


def test_kserve_v2_serves_the_logits_through_tritonclient(text_server, text_artifact):
    import tritonclient.http as triton

    from engines.text import TextEncoder

    name = json.loads((text_artifact / "manifest.json").read_text())["recipe"]["name"]
    client = triton.InferenceServerClient(f"127.0.0.1:{text_server.port}")
    assert client.is_model_ready(name)
    metadata = client.get_model_metadata(name)
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 2]}]
    arrays = TextEncoder(text_artifact / "tokenizer", 128)(TEXTS)
    inputs = []
    for key, array in arrays.items():
        tensor = triton.InferInput(key, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    logits = client.infer(name, inputs).as_numpy("logits")
    assert logits.shape == (2, 2)
    assert np.allclose(logits, artifact_logits(text_artifact, TEXTS), atol=1e-4)


def test_token_classifier_serves_per_token_logits_on_kserve_only(tmp_path_factory):
    import tritonclient.http as triton

    folder = tmp_path_factory.mktemp("ner_model")
    model = tiny_classifiers.tiny_token_classifier(folder / "model", steps=40)
    data = tiny_classifiers.write_jsonl(tiny_classifiers.ner_examples(), folder / "ner.jsonl")
    artifact = build(
        tmp_path_factory,
        "ner",
        model,
        data,
        "model.task=token_classification",
        "evaluate.data.field=tokens",
        "evaluate.data.label_field=tags",
        "evaluate.data.count=16",
        "calibration.source=cpython_docs",  # plain text calibrates a token classifier
    )
    name = json.loads((artifact / "manifest.json").read_text())["recipe"]["name"]
    with running_server(artifact) as server:
        refused = httpx.post(server.url + "/predict", json={"inputs": "x"}, timeout=30)
        assert refused.status_code == 400 and "token_classification" in refused.json()["error"]["message"]
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        ids = np.array([[101, 2065, 1060, 102]], dtype=np.int64)
        inputs = []
        for key, array in {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
        }.items():
            tensor = triton.InferInput(key, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        logits = client.infer(name, inputs).as_numpy("logits")
        assert logits.shape == (1, 4, len(tiny_classifiers.TAGS))
