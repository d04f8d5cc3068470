"""No request takes a served LLM engine down, on the tiny Llama through both engines (ONNX Runtime
GenAI's Engine, OpenVINO GenAI's continuous-batching pipeline):

- each input that killed or poisoned an engine (a huge minItems, $refs doubling at every level, a
  property name outside the BMP, an unbounded maxLength, bounds past int64, a NUL choice) is a 400
  of one line before anything compiles, and the server answers the next request;
- where such an input does reach the engine (the bounds lifted here, so the real engine really
  fails), that request gets a 400, the engine is rebuilt and the next client's request is answered;
- an engine that fails and cannot be rebuilt turns /v2/health/ready and /live to 503 saying why."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.support.serve import in_process, running_server

pytestmark = pytest.mark.slow  # the artifacts are built by the session fixtures

NAME = "tiny_llm"
USER = [{"role": "user", "content": "hi"}]
ENGINES = ["onnxruntime-genai", "openvino-genai"]
ARTIFACT = {"onnxruntime-genai": "tiny_llm_artifact", "openvino-genai": "tiny_ov_llm_artifact"}
# What makes each engine fail inside its step when nothing stops it first: llguidance cannot force a
# character outside the BMP with this tokenizer; xgrammar cannot take a maxLength past int64.
ENGINE_FAILS = {
    "onnxruntime-genai": {"const": "\U0001f642"},
    "openvino-genai": {"type": "string", "minLength": 1, "maxLength": 2**63},
}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def doubling_refs(levels: int) -> dict:
    """A $ref used twice at each level: 2**levels nodes once expanded."""
    defs: dict = {"L0": {"type": "string"}}
    for i in range(1, levels + 1):
        twice = {"$ref": f"#/$defs/L{i - 1}"}
        defs[f"L{i}"] = {"type": "object", "properties": {"a": twice, "b": twice}}
    return {"$defs": defs, "$ref": f"#/$defs/L{levels}"}


POISON = [
    ("response_format", schema_format({"type": "array", "items": {"type": "string"}, "minItems": 1_000_000_000})),
    ("response_format", schema_format(doubling_refs(22))),
    ("response_format", schema_format({"type": "array", "minItems": 100_000, "maxItems": 100_000})),
    (
        "response_format",
        schema_format({"type": "object", "properties": {"\U0001f642": {}}, "required": ["\U0001f642"]}),
    ),
    ("response_format", schema_format({"type": "string", "maxLength": 2**63})),
    ("response_format", schema_format({"type": "integer", "minimum": -1e40, "maximum": 1e40})),
    ("response_format", schema_format({"type": "number", "minimum": 5, "maximum": 1})),
    ("structured_outputs", {"choice": ["\u0000"]}),
    ("structured_outputs", {"regex": "a{1000000}"}),
]


@pytest.fixture(scope="module", params=ENGINES)
def server(request):
    with running_server(request.getfixturevalue(ARTIFACT[request.param]), "--max-tokens", "16") as served:
        yield served


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 4, **body}, timeout=120
    )


def test_each_poisoning_input_is_a_400_and_the_engine_goes_on(server):
    for param, value in POISON:
        response = chat(server.url, **{param: value})
        assert response.status_code == 400, (param, value, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "\n" not in error["message"]
    assert chat(server.url).status_code == 200
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200


@pytest.fixture()
def unbounded(monkeypatch):
    """The structured-output bounds lifted: what they refuse reaches the real engine."""
    import serve.llm.structured

    monkeypatch.setattr(serve.llm.structured, "check_bounds", lambda *args: None)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_that_fails_the_engine_is_refused_and_the_next_client_is_answered(request, engine, unbounded):
    with in_process(request.getfixturevalue(ARTIFACT[engine]), max_tokens=16) as client:
        poisoned = {"messages": USER, "max_tokens": 8, "response_format": schema_format(ENGINE_FAILS[engine])}
        failed = client.post("/v1/chat/completions", json={"model": NAME, **poisoned})
        assert failed.status_code == 400, failed.text
        assert "constraint" in failed.json()["error"]["message"]
        for _ in range(2):  # the rebuilt engine serves the next clients
            answered = client.post("/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 4})
            assert answered.status_code == 200, answered.text
        assert client.get("/v2/health/ready").status_code == 200


def test_an_engine_that_cannot_be_rebuilt_turns_health_to_503(tmp_path, tiny_ov_llm_artifact, unbounded):
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_ov_llm_artifact, artifact)
    with in_process(artifact, max_tokens=16) as client:
        assert client.get("/v2/health/ready").status_code == 200
        engine_dir = next(p for p in artifact.iterdir() if p.is_dir())
        shutil.rmtree(engine_dir)  # loaded already; a rebuild reads it again
        schema = schema_format(ENGINE_FAILS["openvino-genai"])
        failed = client.post("/v1/chat/completions", json={"model": NAME, "messages": USER, "response_format": schema})
        assert failed.status_code == 400, failed.text
        for path in ("/v2/health/ready", "/v2/health/live"):
            health = client.get(path)
            assert health.status_code == 503 and "could not be restarted" in health.json()["error"], path
        later = client.post("/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 4})
        assert later.status_code == 503 and "could not be restarted" in json.dumps(later.json())
