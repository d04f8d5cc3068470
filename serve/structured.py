"""Structured output: what a request's `response_format` (and the `structured_outputs` extension)
asks the generated text to match, as an engines.generation.Constraint, with every limit checked
here, before any engine sees the request.

- `response_format: {"type": "text"}`: no constraint (as when it is absent).
- `{"type": "json_object"}`: any JSON object.
- `{"type": "json_schema", "json_schema": {"name": .., "schema": {..}, "strict": ..}}`: JSON valid
  against the schema (with or without `strict`: the engines' constrained decoding is always strict).
- The extension, vLLM's field: `structured_outputs: {"regex": ".."}`, `{"grammar": ".."}` (in the
  engine's grammar language), `{"choice": [..]}` (one of these strings) or `{"json": {schema}}`.
  One of them per request, and not together with a `response_format` that constrains.

A schema here is plain JSON from the client, so the limits below bound what reaches an engine's
grammar compiler: its size, its nesting, its references (a `$ref` must point inside the schema and
never, through others, back to itself: a recursive schema has no finite compact grammar), and the
size of a regex or grammar. Each refusal is a 400 of one line naming the request field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engines.generation import Constraint
from serve.errors import bad_request


@dataclass(frozen=True)
class StructuredLimits:
    """Bounds on what a request may ask the engine to compile (the one place they are set)."""

    schema_bytes: int = 64 * 1024  # a JSON schema, as compact JSON
    schema_depth: int = 32  # nested objects and arrays within one schema
    pattern_chars: int = 8 * 1024  # a regex or a grammar
    choices: int = 256  # strings of a structured_outputs.choice
    tools: int = 128  # OpenAI's own limit
    tool_name: re.Pattern = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


LIMITS = StructuredLimits()
ANY_JSON_OBJECT = {"type": "object"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
EXTENSION_KINDS = ("regex", "grammar", "choice", "json")


def parse_response_format(data: dict) -> Constraint | None:
    """The constraint a request's `response_format` and `structured_outputs` ask for, or None."""
    constraint = response_format_constraint(data.get("response_format"))
    extension = extension_constraint(data.get("structured_outputs"))
    if constraint is not None and extension is not None:
        raise bad_request("give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
    return constraint or extension


def response_format_constraint(raw) -> Constraint | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("'response_format' must be an object", param="response_format")
    kind = raw.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"response_format.type {kind!r} is not one of {', '.join(RESPONSE_FORMAT_TYPES)}", param="response_format"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_constraint(ANY_JSON_OBJECT, "response_format")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object", param="response_format")
    if spec.get("strict") not in (None, True, False):
        raise bad_request("response_format.json_schema.strict must be true or false", param="response_format")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not LIMITS.tool_name.fullmatch(name)):
        raise bad_request("response_format.json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$", param="response_format")
    schema = spec.get("schema", {})
    return schema_constraint(schema, "response_format")


def extension_constraint(raw) -> Constraint | None:
    param = "structured_outputs"
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request(f"'{param}' must be an object", param=param)
    given = [k for k in EXTENSION_KINDS if raw.get(k) is not None]
    unknown = sorted(set(raw) - set(EXTENSION_KINDS))
    if unknown:
        raise bad_request(f"{param}.{unknown[0]} is not supported (one of {', '.join(EXTENSION_KINDS)})", param=param)
    if len(given) != 1:
        raise bad_request(f"'{param}' takes exactly one of {', '.join(EXTENSION_KINDS)}", param=param)
    kind, value = given[0], raw[given[0]]
    if kind == "json":
        return schema_constraint(value, param)
    if kind == "choice":
        return Constraint("regex", choice_regex(value, param))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{kind} must be a non-empty string", param=param)
    if len(value) > LIMITS.pattern_chars:
        raise bad_request(f"{param}.{kind} has {len(value)} characters; at most {LIMITS.pattern_chars}", param=param)
    if kind == "regex":
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as exc:
            raise bad_request(f"{param}.regex is not a regular expression: {exc}", param=param) from None
    return Constraint("regex" if kind == "regex" else "grammar", value)


def choice_regex(values, param: str) -> str:
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise bad_request(f"{param}.choice must be a non-empty list of non-empty strings", param=param)
    if len(values) > LIMITS.choices:
        raise bad_request(f"{param}.choice has {len(values)} strings; at most {LIMITS.choices}", param=param)
    pattern = "|".join(re.escape(v) for v in values)
    if len(pattern) > LIMITS.pattern_chars:
        raise bad_request(f"{param}.choice is too long: at most {LIMITS.pattern_chars} characters", param=param)
    return f"(?:{pattern})"


def schema_constraint(schema, param: str) -> Constraint:
    check_schema(schema, param)
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))


def check_schema(schema, param: str, what: str = "the JSON schema") -> None:
    """A schema an engine may be handed: an object (or true), small, shallow, its $refs local and
    acyclic. Everything else about it is the engine's to judge (its refusal is a 400 too)."""
    if schema is True:
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{what} must be an object", param=param)
    depth = nesting(schema)  # first: json.dumps of a deep schema would recurse as deep
    if depth > LIMITS.schema_depth:
        raise bad_request(f"{what} nests {depth} levels deep; at most {LIMITS.schema_depth}", param=param)
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > LIMITS.schema_bytes:
        raise bad_request(f"{what} is {size} bytes as JSON; at most {LIMITS.schema_bytes}", param=param)
    problem = ref_problem(schema)
    if problem:
        raise bad_request(f"{what}: {problem}", param=param)


def nesting(value: Any) -> int:
    """Levels of objects and arrays, counted without recursion (the depth is what is being checked)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def resolve_ref(root: dict, ref: str):
    """What a local `$ref` ("#", "#/$defs/Name", ...) points at; None when it points nowhere."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def refs_in(node: Any) -> list[str]:
    found, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.append(item["$ref"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def ref_problem(schema: dict) -> str:
    """What is wrong with the schema's $refs ("" if nothing): one that is not local or points
    nowhere, or a chain of them that leads back to where it started (a recursive schema)."""
    edges: dict[str, list[str]] = {}
    todo = ["#"]
    while todo:
        ref = todo.pop()
        if ref in edges:
            continue
        target = resolve_ref(schema, ref)
        if target is None:
            return f"$ref {ref!r} points nowhere inside the schema (only local refs are taken)"
        edges[ref] = refs_in(target)
        todo.extend(edges[ref])
    for start in edges:
        path = reaches(edges, start)
        if path:
            return f"it refers to itself ({' -> '.join(path)}); recursive schemas are refused"
    return ""


def reaches(edges: dict[str, list[str]], start: str) -> list[str]:
    """A path of refs from `start` back to itself, or []."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        ref, path = stack.pop()
        for nxt in edges.get(ref, []):
            if nxt == start:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return []
