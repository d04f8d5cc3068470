"""An OpenVINO artifact is served exactly as an ONNX Runtime one: a real `python -m serve` on
loopback, answered through tritonclient (KServe v2) and the openai client, with the same numbers the
artifact's own Runner gives."""

from __future__ import annotations

import numpy as np
import pytest

import engines
from engines.artifact import read_manifest
from engines.text import TextEncoder
from tests.support.serve import running_server


@pytest.fixture(scope="module")
def served(openvino_artifact):
    with running_server(openvino_artifact) as server:
        yield server, read_manifest(openvino_artifact)["recipe"]["name"]


def test_kserve_and_openai_clients_get_the_runners_numbers(served, openvino_artifact):
    import openai
    import tritonclient.http as triton

    server, name = served
    manifest = read_manifest(openvino_artifact)
    assert manifest["engine"]["format"] == "openvino" and manifest["engine"]["file"].endswith(".xml")
    texts = ["OpenVINO runs this model.", "def f(x): return x"]
    arrays = TextEncoder(openvino_artifact / "tokenizer", 128)(texts)
    expected = engines.load(openvino_artifact)(arrays)["sentence_embedding"]

    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert client.is_model_ready(name)
    metadata = client.get_model_metadata(name)
    assert [i["name"] for i in metadata["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert {o["name"]: o["shape"] for o in metadata["outputs"]}["sentence_embedding"] == [-1, 384]
    inputs = []
    for input_name, array in arrays.items():
        tensor = triton.InferInput(input_name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array.astype(np.int64))
        inputs.append(tensor)
    result = client.infer(name, inputs, outputs=[triton.InferRequestedOutput("sentence_embedding")])
    assert np.allclose(result.as_numpy("sentence_embedding"), expected, atol=1e-4)

    openai_client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    answer = openai_client.embeddings.create(model=name, input=texts, encoding_format="float")
    served_vectors = np.array([d.embedding for d in answer.data], dtype=np.float32)
    assert np.allclose(served_vectors, expected, atol=1e-4)
