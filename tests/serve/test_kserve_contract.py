"""This server's Open Inference Protocol v2 JSON against the kserve package's own pydantic models
(what KServe's clients, its InferenceGraph and its transformers parse), on the real encoder artifact."""

from __future__ import annotations

import pytest
from kserve.protocol.rest import v2_datamodels as v2  # make install puts kserve in, without its pins

from tests.support.serve import kserve_tensors

IDS = [[101, 7592, 2088, 102], [101, 2088, 7592, 102]]


def test_health_answers_by_status(encoder, encoder_name):
    """The protocol's health routes answer by status code, with an empty body (KServe's server adds
    {"live": true}; its clients read the status)."""
    assert encoder.get("/v2/health/live").status_code == 200
    assert encoder.get("/v2/health/ready").status_code == 200
    assert encoder.get(f"/v2/models/{encoder_name}/ready").status_code == 200


def test_server_and_model_metadata_parse_as_kserve_reads_them(encoder, encoder_name):
    server = v2.ServerMetadataResponse.model_validate(encoder.get("/v2").json())
    assert server.name == "serve"
    model = v2.ModelMetadataResponse.model_validate(encoder.get(f"/v2/models/{encoder_name}").json())
    assert model.name == encoder_name and model.platform
    assert [t.name for t in model.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(t.datatype == "INT64" for t in model.inputs)


@pytest.mark.parametrize("request_id", ["req-7", None])
def test_inference_request_and_response_are_kserve_models(encoder, encoder_name, request_id):
    body = {"inputs": kserve_tensors(IDS), "outputs": [{"name": "sentence_embedding"}]}
    if request_id:
        body["id"] = request_id
    sent = v2.InferenceRequest.model_validate(body)  # what a KServe client would send, as it builds it
    json_type = {"content-type": "application/json"}
    url = f"/v2/models/{encoder_name}/infer"
    response = encoder.post(url, content=sent.model_dump_json(exclude_none=True), headers=json_type)
    assert response.status_code == 200, response.text
    got = v2.InferenceResponse.model_validate(response.json())
    assert got.model_name == encoder_name and got.id  # KServe's model requires an id; one is made when none was sent
    if request_id:
        assert got.id == request_id
    (output,) = got.outputs
    assert output.name == "sentence_embedding" and output.datatype == "FP32" and output.shape == [2, 384]
    assert len(output.data) == 2 * 384
