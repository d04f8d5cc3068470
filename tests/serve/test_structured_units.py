"""The structured-output and tool-call pieces without a model: the limits a request meets before any
engine sees it, the constraint a forced tool call becomes, the tool-call parser, and OpenVINO GenAI's
compact grammar (which must refuse what xgrammar would fail to compile: that breaks its batch)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from serve.errors import HTTPError
from serve.llm.tool_parser import parse_tool_calls
from serve.protocols.openai import parse_chat_request

USER = [{"role": "user", "content": "hi"}]
NOW_CALL = {"name": "now", "arguments": "{}"}
TWO = [("now", {}), ("now", {"b": 2})]


def chat(**body):
    return parse_chat_request({"model": "m", "messages": USER, **body})


def refused(**body) -> HTTPError:
    with pytest.raises(HTTPError) as caught:
        chat(**body)
    assert caught.value.status == 400 and "\n" not in caught.value.message
    return caught.value


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_response_formats_become_constraints():
    assert chat(response_format={"type": "text"}).constraint is None
    assert json.loads(chat(response_format={"type": "json_object"}).constraint.value) == {"type": "object"}
    constraint = chat(response_format=schema_format({"type": "integer"})).constraint
    assert (constraint.kind, json.loads(constraint.value)) == ("json_schema", {"type": "integer"})
    assert chat(structured_outputs={"grammar": 'start: "a"'}).constraint.kind == "grammar"
    assert chat(structured_outputs={"choice": ["a.b", "c"]}).constraint.value == r"(?:a\.b|c)"
    assert refused(response_format={"type": "yaml"}).param == "response_format"
    assert refused(structured_outputs={"regex": "(", "grammar": "x"}).param == "structured_outputs"


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, "refers to itself"),
        ({"$defs": {"A": {"properties": {"n": {"$ref": "#/$defs/A"}}}}, "$ref": "#/$defs/A"}, "refers to itself"),
        ({"$ref": "https://example.com/s.json"}, "points nowhere"),
        (json.loads("[" * 40 + "]" * 40) and {"examples": json.loads("[" * 40 + "]" * 40)}, "nests"),
        ({"enum": ["x" * 70_000]}, "bytes"),
    ],
)
def test_hostile_schemas_are_refused_before_an_engine(schema, words):
    assert words in refused(response_format=schema_format(schema)).message


def doubling_refs(levels: int) -> dict:
    defs: dict = {"L0": {"type": "string"}}
    for i in range(1, levels + 1):
        twice = {"$ref": f"#/$defs/L{i - 1}"}
        defs[f"L{i}"] = {"type": "object", "properties": {"a": twice, "b": twice}}
    return {"$defs": defs, "$ref": f"#/$defs/L{levels}"}


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "array", "items": {"type": "string"}, "minItems": 1_000_000_000}, "'minItems' is 1000000000"),
        ({"type": "array", "maxItems": 1025}, "at most 1024"),
        ({"type": "array", "minItems": -1}, "non-negative integer"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "nothing fits"),
        ({"type": "array", "minContains": 2000}, "'minContains'"),
        ({"type": "string", "maxLength": 2**63}, "'maxLength' is 9223372036854775808"),
        ({"type": "string", "minLength": 20_000}, "at most 16384"),
        ({"type": "string", "minLength": True}, "non-negative integer"),
        ({"type": "object", "minProperties": 5000}, "'minProperties'"),
        ({"type": "object", "maxProperties": 5000}, "'maxProperties'"),
        ({"type": "integer", "minimum": -1e40, "maximum": 1e40}, "at most 1e+15"),
        ({"type": "number", "maximum": float("inf")}, "finite"),
        ({"type": "number", "minimum": "0"}, "finite number"),
        ({"type": "number", "exclusiveMinimum": True}, "finite number"),
        ({"type": "number", "minimum": 5, "maximum": 1}, "no number fits"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number fits"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no number fits"),
        ({"type": "integer", "minimum": 0.5, "maximum": 0.7}, "whole number"),
        ({"type": "number", "multipleOf": 0}, "'multipleOf'"),
        ({"type": "number", "multipleOf": 1e-300}, "'multipleOf'"),
        ({"enum": list(range(1001))}, "'enum' has 1001 values"),
        ({"enum": []}, "non-empty list"),
        ({"enum": ["a\x00b"]}, "U+0000"),
        ({"const": "\U0001f642"}, "Basic Multilingual Plane"),
        ({"const": {"nested": ["\ud800"]}}, "surrogate"),
        ({"description": "\udfff"}, "surrogate"),
        ({"type": "object", "properties": {"\U0001f642": {}}, "required": ["\U0001f642"]}, "property name"),
        ({"type": "object", "properties": {"a\nb": {}}}, "U+000A"),
        ({"type": "string", "pattern": "a{1000000}"}, "repeats 1000000 times"),
        ({"type": "string", "pattern": "(?:(?:a{1000}){1000}){1000}"}, "expands to over"),
        (doubling_refs(22), "expands to over 4096 nodes"),
        ({"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1024}, "expands to over"),
        ({"type": "object", "properties": {"deep": {"type": "array", "maxItems": -2}}}, "at /properties/deep"),
    ],
)
def test_every_bound_is_a_400_before_an_engine(schema, words):
    error = refused(response_format=schema_format(schema))
    assert error.param == "response_format" and words in error.message, error.message


def test_a_forced_tool_calls_schema_is_bounded_as_well():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "minItems": 10**9}}}
    assert "minItems" in refused(tools=[tool], tool_choice="required").message


@pytest.mark.parametrize(
    "extension, words",
    [
        ({"choice": ["\u0000"]}, "U+0000"),
        ({"choice": ["ok", "\U0001f642"]}, "Basic Multilingual Plane"),
        ({"choice": ["\ud800"]}, "surrogate"),
        ({"regex": "a{1000000}"}, "repeats 1000000 times"),
        ({"regex": "(a{1000}){1000}"}, "expands to over 16384"),
        ({"regex": "a\x00"}, "U+0000"),
        ({"regex": "("}, "not a regular expression"),
        ({"grammar": 'start: "a"{5000}'}, "repeats 5000 times"),
        ({"grammar": "start: /[a-z]{1,99999}/"}, "repeats 99999 times"),
    ],
)
def test_regex_choice_and_grammar_bounds(extension, words):
    error = refused(structured_outputs=extension)
    assert error.param == "structured_outputs" and words in error.message, error.message


@pytest.mark.parametrize(
    "schema",
    [
        doubling_refs(8),  # 2**8 leaves: far below the cap
        {"type": "array", "items": {"type": "string"}, "minItems": 1024, "maxItems": 1024},
        {"type": "integer", "minimum": -(10**15), "maximum": 10**15},
        {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 3},
        {"type": "number", "minimum": 0.5, "maximum": 0.5, "multipleOf": 0.25},
        {"type": "string", "minLength": 1, "maxLength": 16384, "pattern": "[a-z]{1,1024}"},
        {"enum": ["caf\u00e9", "\u4e2d", 3, None], "description": "emoji only here: \U0001f642"},
        {"type": "object", "properties": {"minItems": {"type": "string"}}, "required": ["minItems"]},
    ],
)
def test_what_real_applications_ask_is_taken(schema):
    assert chat(response_format=schema_format(schema)).constraint.kind == "json_schema"


def test_tool_limits():
    now = {"type": "function", "function": {"name": "now"}}
    assert refused(tools=[now] * 129).param == "tools"
    assert refused(tools=[{"type": "function", "function": {"name": "a\nb"}}]).param == "tools"
    assert refused(tools=[now, now]).param == "tools"
    assert refused(tools=[now], tool_choice={"type": "function", "function": {"name": "later"}}).param == "tool_choice"
    assert refused(tool_choice="required").param == "tool_choice"
    assert refused(structured_outputs={"regex": "a" * 10_000}).param == "structured_outputs"


def test_a_forced_call_is_constrained_to_the_tools_and_their_rebased_refs():
    point = {"$defs": {"P": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/P"}}}
    tools = [
        {"type": "function", "function": {"name": "move", "parameters": point}},
        {"type": "function", "function": {"name": "now"}},
    ]
    request = chat(tools=tools, tool_choice="required")
    schema = json.loads(request.constraint.value)
    assert [s["properties"]["name"]["const"] for s in schema["anyOf"]] == ["move", "now"]
    assert schema["anyOf"][0]["properties"]["arguments"]["properties"]["x"]["$ref"] == (
        "#/anyOf/0/properties/arguments/$defs/P"
    )
    assert schema["anyOf"][1]["properties"]["arguments"]["additionalProperties"] is False
    assert refused(tools=tools, tool_choice="required", response_format={"type": "json_object"}).param == "tool_choice"


def test_history_keeps_tool_calls_and_tool_messages():
    messages = [
        *USER,
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": NOW_CALL}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    parsed = parse_chat_request({"model": "m", "messages": messages}).messages
    assert parsed[1]["tool_calls"][0]["function"] == {"name": "now", "arguments": {}}
    assert parsed[2]["tool_call_id"] == "call_1"


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name":"now","arguments":{}}', None, [("now", {})]),
        ('ok <tool_call>{"name": "now", "arguments": {"a": 1}}</tool_call>', "ok", [("now", {"a": 1})]),
        ('{"tool_calls":[{"name":"now","arguments":{}},{"name":"now","parameters":{"b":2}}]}', None, TWO),
        ('{"name":"other","arguments":{}}', '{"name":"other","arguments":{}}', []),
        ("just text", "just text", []),
    ],
)
def test_the_tool_call_parser(text, content, calls):
    got_content, got = parse_tool_calls(text, {"now"})
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") for c in got)


needs_openvino_genai = pytest.mark.skipif(
    importlib.util.find_spec("openvino_genai") is None, reason="openvino-genai is not installed"
)


@needs_openvino_genai
@pytest.mark.parametrize(
    "constraint, words",
    [
        (("regex", "(?=a)a"), "(?="),
        (("regex", r"(a)\1"), "\\1"),
        (("grammar", 'root ::= "a"'), "no grammar"),
        (("json_schema", '{"type": 5}'), "unknown JSON schema type"),
        (("json_schema", '{"type": "object", "minProperties": 1}'), "minProperties"),
        (("json_schema", '{"type": "string", "format": "weird"}'), "format"),
    ],
)
def test_openvino_refuses_what_xgrammar_would_fail_on(constraint, words):
    import openvino_genai

    from engines.generation import Constraint
    from engines.openvino.structured import UnsupportedConstraint, structured_output_config

    with pytest.raises(UnsupportedConstraint, match="") as caught:
        structured_output_config(openvino_genai, Constraint(*constraint))
    assert words in str(caught.value)
