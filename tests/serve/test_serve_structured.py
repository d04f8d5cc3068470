"""Structured output and tool calls with the official openai client against a real server on
loopback, on the tiny Llama served by both engines (ONNX Runtime GenAI's Engine and OpenVINO GenAI's
continuous-batching pipeline): a pydantic response_format parsed, forced tool calls whose arguments
validate against the tool's schema (streamed and not), a tool round trip, and each hostile input a
400 of one line that leaves the server answering."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.support.serve import running_server

NAME = "tiny_llm"
WEATHER = {
    "type": "function",
    "function": {
        "name": "wx",
        "parameters": {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 6}}},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: arguments {}
USER = [{"role": "user", "content": "hi"}]


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module", params=["onnxruntime-genai", "openvino-genai"])
def server(request):
    artifact = request.getfixturevalue(
        "tiny_llm_artifact" if request.param == "onnxruntime-genai" else "tiny_ov_llm_artifact"
    )
    with running_server(artifact, "--max-tokens", "48") as served:
        yield served


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def validator(schema: dict):
    import jsonschema_rs

    return jsonschema_rs.validator_for(schema)


def test_parse_with_a_pydantic_model_returns_the_object(client):
    completion = client.chat.completions.parse(
        model=NAME, messages=USER, response_format=Pet, max_tokens=48, temperature=0
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.age <= 30


def test_regex_and_choice_extension(client):
    for extension in ({"regex": "(yes|no)"}, {"choice": ["red", "green"]}):
        reply = client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=8, extra_body={"structured_outputs": extension}
        )
        assert reply.choices[0].message.content in ("yes", "no", "red", "green")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "wx"}}])
def test_a_forced_tool_call_validates_against_the_tools_schema(client, choice):
    reply = client.chat.completions.create(
        model=NAME, messages=USER, tools=[WEATHER], tool_choice=choice, max_tokens=40
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "wx"
    assert validator(WEATHER["function"]["parameters"]).is_valid(json.loads(call.function.arguments))


def test_a_forced_tool_call_streams_as_delta_tool_calls(client):
    with client.chat.completions.stream(
        model=NAME, messages=USER, tools=[WEATHER, NOW], tool_choice="required", max_tokens=33
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    (call,) = final.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("wx", "now")
    schema = WEATHER if call.function.name == "wx" else {"function": {"parameters": {"type": "object"}}}
    assert validator(schema["function"]["parameters"]).is_valid(json.loads(call.function.arguments))


def test_a_tool_without_parameters_is_called_with_empty_arguments(client):
    choice = {"type": "function", "function": {"name": "now"}}
    reply = client.chat.completions.create(model=NAME, messages=USER, tools=[NOW], tool_choice=choice, max_tokens=30)
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {}


def test_a_tool_round_trip_is_answered(client):
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    reply = client.chat.completions.create(model=NAME, messages=history, tools=[NOW], tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def refusal(server, raw: str = "", **body) -> dict:
    """A 400 of one line; `raw` is JSON text put in as the body's last field (too deep for json.dumps)."""
    text = json.dumps({"model": NAME, "messages": USER, "max_tokens": 4, **body})
    if raw:
        text = text[:-1] + ", " + raw + "}"
    response = httpx.post(
        server.url + "/v1/chat/completions", content=text, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "\n" not in error["message"]
    return error


def deep_schema_format(levels: int) -> str:
    schema = '{"type":"object","properties":{"a":' * levels + '{"type":"object"}' + "}}" * levels
    return '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":' + schema + "}}"


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_unknown_response_format_and_hostile_inputs_are_400s_and_the_server_goes_on(server, client):
    def schema_format(schema):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    assert refusal(server, response_format={"type": "yaml"})["param"] == "response_format"
    refusal(server, raw=deep_schema_format(10_000))
    assert refusal(server, response_format=schema_format(nested_schema(100)))["param"] == "response_format"
    recursive = {"type": "object", "properties": {"next": {"$ref": "#"}}}
    assert refusal(server, response_format=schema_format(recursive))["param"] == "response_format"
    assert refusal(server, structured_outputs={"regex": "a" * (1 << 20)})["param"] == "structured_outputs"
    assert refusal(server, tools=[NOW] * 1000)["param"] == "tools"
    newline = {"type": "function", "function": {"name": "get\nweather"}}
    assert refusal(server, tools=[newline])["param"] == "tools"
    assert refusal(server, response_format=schema_format({"type": 5}))["param"] == "response_format"
    assert refusal(server, tools=[NOW], tool_choice={"type": "function", "function": {"name": "later"}})["param"] == (
        "tool_choice"
    )
    reply = client.chat.completions.create(model=NAME, messages=USER, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
