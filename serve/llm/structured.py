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
    """Bounds on what a request may ask the engine to compile (the one place they are set). Each is
    far above what a real application asks (OpenAI's structured outputs take at most 5000 object
    properties, 10 levels of nesting and 1000 enum values) and below what the engines' grammar
    compilers were measured to choke on: xgrammar (OpenVINO GenAI) compiles a grammar inside the
    batch's step, about 0.5 ms per node of the expanded grammar, so 1024 array items of a 16-character
    string took 7.6 s of everyone's step; a minItems of 10**9 made it build the list (20 GB) and made
    llguidance (ONNX Runtime GenAI) abort the process allocating 8 GB."""

    schema_bytes: int = 64 * 1024  # a JSON schema, as compact JSON
    schema_depth: int = 32  # nested objects and arrays within one schema
    pattern_chars: int = 8 * 1024  # a regex or a grammar
    choices: int = 256  # strings of a structured_outputs.choice
    tools: int = 128  # OpenAI's own limit
    tool_name: re.Pattern = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
    # minItems/maxItems (and minContains/maxContains): an answer of more than 1024 items does not fit
    # a reply's max_tokens anyway, and each required item is a copy of the item's grammar.
    array_items: int = 1024
    # minLength/maxLength: 16384 characters is pages of text; a counted string compiles as a regex
    # repeated that many times.
    string_length: int = 16 * 1024
    object_properties: int = 1024  # minProperties/maxProperties
    enum_values: int = 1000  # one enum's values (OpenAI's limit across a whole schema)
    # minimum/maximum/exclusive*/multipleOf: within +-1e15 (float64 counts every integer exactly
    # there); xgrammar fails its batch's step on an integer bound beyond int64 (-1e40).
    number_magnitude: float = 1e15
    smallest_multiple: float = 1e-9  # multipleOf: a number with more decimals is no JSON a model writes
    # The schema's size once each $ref is replaced by what it points at and each array by its items
    # (minItems or maxItems copies of the item's grammar) and each counted string by its count: what
    # the compilers build. 4096 compiles in about 2 s on xgrammar at worst (measured: 1024 plain
    # string items 0.4 s, 1024 items of 16 counted characters 7.6 s); a $ref used twice at each of 22
    # levels is 2**22 and took over 60 s.
    expanded_nodes: int = 4096
    # {n}, {n,m} in a regex (a pattern, structured_outputs.regex or a grammar): each count, and the
    # characters the whole regex expands to with nested counts multiplied.
    regex_count: int = 1024
    regex_expanded: int = 16 * 1024


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
        check_pattern(value, f"{param}.regex", param)
    else:
        check_grammar(value, f"{param}.grammar", param)
    return Constraint("regex" if kind == "regex" else "grammar", value)


def choice_regex(values, param: str) -> str:
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise bad_request(f"{param}.choice must be a non-empty list of non-empty strings", param=param)
    if len(values) > LIMITS.choices:
        raise bad_request(f"{param}.choice has {len(values)} strings; at most {LIMITS.choices}", param=param)
    for value in values:
        check_text(value, f"{param}.choice's string {value[:40]!r}", param)
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
    check_bounds(schema, param, what)


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


# --- bounds on what a schema, regex or grammar makes the engine build --------------------------------

# Keywords whose values are schemas: a map of them, one, or a list of them (the rest is data).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
COUNT_PAIRS = {
    ("minItems", "maxItems"): "array_items",
    ("minContains", "maxContains"): "array_items",
    ("minLength", "maxLength"): "string_length",
    ("minProperties", "maxProperties"): "object_properties",
}
NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Characters no grammar compiler is handed: C0 controls and DEL (xgrammar fails its batch's step on a
# NUL in a regex; a JSON string holds them only escaped), and, in text the grammar forces, characters
# outside the Basic Multilingual Plane: llguidance (ONNX Runtime GenAI) forces their 4 UTF-8 bytes
# against the tokenizer's byte tokens, fails ("forced bytes ... doesn't satisfy the grammar") and its
# Engine is then unhealthy for every request.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
CONTROL_IN_PATTERN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # a regex or grammar may hold \t \n \r
SURROGATE = re.compile(r"[\ud800-\udfff]")
ASTRAL = re.compile(r"[\U00010000-\U0010ffff]")
GRAMMAR_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def text_problem(text: str, controls: re.Pattern = CONTROL) -> str:
    """What makes a string unfit for a grammar compiler ("" if nothing)."""
    if SURROGATE.search(text):
        return "holds a lone surrogate (not valid Unicode)"
    found = controls.search(text)
    if found:
        return f"holds the control character U+{ord(found.group()):04X}"
    found = ASTRAL.search(text)
    if found:
        return (
            f"holds {found.group()!r} (U+{ord(found.group()):X}), outside the Basic Multilingual Plane: "
            "the engines' grammars cannot force it"
        )
    return ""


def check_text(text: str, what: str, param: str, controls: re.Pattern = CONTROL) -> None:
    problem = text_problem(text, controls)
    if problem:
        raise bad_request(f"{what} {problem}", param=param)


def check_pattern(pattern: str, what: str, param: str) -> None:
    """A regex's characters, each counted repetition and what the whole expands to."""
    from re import _constants as c  # type: ignore[attr-defined]
    from re import _parser  # type: ignore[attr-defined]

    check_text(pattern, what, param, CONTROL_IN_PATTERN)
    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise bad_request(f"{what} is not a regular expression: {exc}", param=param) from None

    def expanded(items) -> int:
        total = 0
        for op, av in items:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
                low, high, sub = av
                for count in (low, high):
                    if count != c.MAXREPEAT and count > LIMITS.regex_count:
                        raise bad_request(f"{what} repeats {count} times; at most {LIMITS.regex_count}", param=param)
                total += max(1, low if high == c.MAXREPEAT else high) * expanded(sub)
            elif op is c.SUBPATTERN:
                total += expanded(av[-1])
            elif op is c.BRANCH:
                total += sum(expanded(branch) for branch in av[1])
            elif op in (c.ASSERT, c.ASSERT_NOT):
                total += expanded(av[1])
            else:
                total += 1
            total = min(total, LIMITS.regex_expanded + 1)  # past the cap the exact size does not matter
        return total

    size = expanded(parsed)
    if size > LIMITS.regex_expanded:
        raise bad_request(
            f"{what} expands to over {LIMITS.regex_expanded} characters with its repetitions counted", param=param
        )


def check_grammar(grammar: str, what: str, param: str) -> None:
    """A grammar's characters and its counted repetitions (x{n,m}, in its rules or its regexes)."""
    check_text(grammar, what, param, CONTROL_IN_PATTERN)
    for match in GRAMMAR_COUNT.finditer(grammar):
        for count in match.groups():
            if count and int(count) > LIMITS.regex_count:
                raise bad_request(f"{what} repeats {count} times; at most {LIMITS.regex_count}", param=param)


def check_bounds(schema: Any, param: str, what: str) -> None:
    """Every keyword of every subschema held to LIMITS, then the expanded size (after check_schema's
    depth and $ref checks, so that the walks here end)."""
    for node, pointer in subschemas(schema):
        where = f"{what} at {pointer or '/'}"
        check_counts(node, where, param)
        check_numbers(node, where, param)
        check_values(node, where, param)
        check_names(node, where, param)
        if isinstance(node.get("pattern"), str):
            check_pattern(node["pattern"], f"{where}: 'pattern'", param)
    check_strings(schema, what, param)
    size = expanded_size(schema)
    if size > LIMITS.expanded_nodes:
        raise bad_request(
            f"{what} expands to over {LIMITS.expanded_nodes} nodes with its $refs and array items counted",
            param=param,
        )


def subschemas(schema: Any):
    """(subschema, JSON pointer) of every object where the schema keywords put schemas."""
    stack = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, pointer
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((v, f"{pointer}/{key}/{k}") for k, v in node[key].items())
        for key in SCHEMA_ONE:
            stack.append((node.get(key), f"{pointer}/{key}"))
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((v, f"{pointer}/{key}/{i}") for i, v in enumerate(node[key]))


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_counts(node: dict, where: str, param: str) -> None:
    for (low_key, high_key), limit_name in COUNT_PAIRS.items():
        limit = getattr(LIMITS, limit_name)
        for key in (low_key, high_key):
            if key in node and not is_count(node[key]):
                raise bad_request(f"{where}: {key!r} must be a non-negative integer", param=param)
            if key in node and node[key] > limit:
                raise bad_request(f"{where}: {key!r} is {node[key]}; at most {limit}", param=param)
        if node.get(low_key, 0) > node.get(high_key, limit):
            raise bad_request(f"{where}: {low_key!r} is above {high_key!r}: nothing fits", param=param)


def check_numbers(node: dict, where: str, param: str) -> None:
    """Finite, within +-number_magnitude, a range something fits in (a whole number for an integer)."""
    import math

    for key in NUMBER_BOUNDS:
        if key not in node:
            continue
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"{where}: {key!r} must be a finite number", param=param)
        if abs(value) > LIMITS.number_magnitude:
            raise bad_request(f"{where}: {key!r} is {value}; at most {LIMITS.number_magnitude:g} in size", param=param)
    multiple = node.get("multipleOf")
    if multiple is not None and multiple < LIMITS.smallest_multiple:
        raise bad_request(f"{where}: 'multipleOf' must be at least {LIMITS.smallest_multiple:g}", param=param)
    integer = node.get("type") == "integer"
    if integer:
        for key in NUMBER_BOUNDS[:4]:
            if key in node and node[key] != math.floor(node[key]):
                raise bad_request(f"{where}: {key!r} of an integer must be a whole number", param=param)
    low = max((node[k] for k in ("minimum", "exclusiveMinimum") if k in node), default=None)
    high = min((node[k] for k in ("maximum", "exclusiveMaximum") if k in node), default=None)
    if low is None or high is None:
        return
    open_low = "exclusiveMinimum" in node and node["exclusiveMinimum"] == low
    open_high = "exclusiveMaximum" in node and node["exclusiveMaximum"] == high
    if integer:  # the smallest and largest integers inside
        low, high = low + 1 if open_low else low, high - 1 if open_high else high
        empty = low > high
    else:
        empty = low > high or (low == high and (open_low or open_high))
    if empty:
        raise bad_request(f"{where}: its minimum is above its maximum: no number fits", param=param)


def check_values(node: dict, where: str, param: str) -> None:
    """enum and const: a bounded list, and strings a grammar can force (checked by check_strings)."""
    if "enum" not in node:
        return
    values = node["enum"]
    if not isinstance(values, list) or not values:
        raise bad_request(f"{where}: 'enum' must be a non-empty list", param=param)
    if len(values) > LIMITS.enum_values:
        raise bad_request(f"{where}: 'enum' has {len(values)} values; at most {LIMITS.enum_values}", param=param)


def check_names(node: dict, where: str, param: str) -> None:
    """Property names (and those `required` lists) are forced text: held to text_problem."""
    names = list(node["properties"]) if isinstance(node.get("properties"), dict) else []
    if isinstance(node.get("required"), list):
        names += [name for name in node["required"] if isinstance(name, str)]
    for name in names:
        problem = text_problem(name)
        if problem:
            raise bad_request(f"{where}: the property name {name!r} {problem}", param=param)


def check_strings(schema: Any, what: str, param: str) -> None:
    """Every string of the schema is valid Unicode; those of enum and const values (text a grammar
    forces) also hold no control character and nothing outside the Basic Multilingual Plane."""
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        item, forced = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item) if forced else ("holds a lone surrogate" if SURROGATE.search(item) else "")
            if problem:
                raise bad_request(f"{what}: the string {item[:40]!r} {problem}", param=param)
        elif isinstance(item, dict):
            for key, value in item.items():
                stack.append((key, forced))
                stack.append((value, forced or key in ("enum", "const")))
        elif isinstance(item, list):
            stack.extend((value, forced) for value in item)


def expanded_size(schema: Any) -> int:
    """Nodes the schema stands for with each $ref replaced by its target and each array by its items
    (max(1, minItems, maxItems) copies) and each counted string by its count: memoized by $ref, so a
    ref used twice at each of N levels costs N computations and counts 2**N. Capped just past
    LIMITS.expanded_nodes (the exact size beyond does not matter). The refs are acyclic (check_schema)."""
    cap = LIMITS.expanded_nodes + 1
    sizes: dict[str, int] = {}
    for ref in refs_in_dependency_order(schema):
        sizes[ref] = node_size(resolve_ref(schema, ref), sizes, cap)
    return sizes.get("#", node_size(schema, sizes, cap))


def refs_in_dependency_order(schema: Any) -> list[str]:
    """Every $ref reachable from the root ("#" last), each after the refs its target uses."""
    order: list[str] = []
    done: set[str] = set()
    stack: list[tuple[str, bool]] = [("#", False)]
    while stack:
        ref, expanded = stack.pop()
        if ref in done:
            continue
        if expanded:
            done.add(ref)
            order.append(ref)
            continue
        stack.append((ref, True))
        stack.extend((nxt, False) for nxt in refs_in(resolve_ref(schema, ref)) if nxt not in done)
    return order


def node_size(node: Any, sizes: dict[str, int], cap: int) -> int:
    """One subschema's expanded size (recursion as deep as its nesting, bounded by check_schema)."""
    if not isinstance(node, dict):
        return 1
    if isinstance(node.get("$ref"), str):
        return min(cap, 1 + sizes.get(node["$ref"], cap))
    total = 1 + counted_string(node)
    for key in SCHEMA_MAPS:
        if key in ("$defs", "definitions"):  # counted where a $ref uses them
            continue
        if isinstance(node.get(key), dict):
            total += sum(node_size(v, sizes, cap) for v in node[key].values())
    for key in SCHEMA_ONE:
        if key in node and key != "items":
            total += node_size(node[key], sizes, cap)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            total += sum(node_size(v, sizes, cap) for v in node[key])
    items = node.get("items")
    if items is not None:
        copies = max([1] + [node[k] for k in ("minItems", "maxItems") if is_count(node.get(k))])
        parts = items if isinstance(items, list) else [items]
        total += copies * sum(node_size(v, sizes, cap) for v in parts)
    return min(total, cap)


def counted_string(node: dict) -> int:
    """Characters a string's length bounds make the compiler count (as a repeated regex)."""
    counts = [node[k] for k in ("minLength", "maxLength") if is_count(node.get(k))]
    return min(max(counts, default=0), 512)
