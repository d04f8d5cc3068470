"""Constrained decoding for the OpenVINO GenAI engines: an engines.generation.Constraint as the
`StructuredOutputConfig` of a request (xgrammar underneath), checked before the engine sees it.

Two things measured on openvino-genai 2026.4 shape this module:
- A grammar xgrammar fails to compile fails the continuous-batching pipeline's step(), and the
  pipeline never steps again (every running request is lost). So nothing reaches the engine that
  has not been checked here: JSON schemas are rebuilt from parts whose compilation is known to
  succeed, regexes are held to the syntax xgrammar's converter takes, and EBNF grammars (which
  only the compiler itself could check) are refused.
- Its JSON-schema grammar lets whitespace run anywhere between tokens, and a model that likes a
  whitespace token (the tiny test model does) writes "{" and then spaces until max_tokens. So a JSON
  schema is rebuilt as a compact grammar (no whitespace between tokens): objects and arrays as
  sequences of constant strings and their members' grammars, alternatives as unions, and only
  leaves (strings, bounded numbers) left to xgrammar's JSON-schema converter, where no whitespace
  can appear. Every property of an object is written, in its schema's order (valid whether or not
  the schema requires them: what OpenAI's strict mode asks anyway); arrays hold at most
  ARRAY_ITEMS_WRITTEN items past their minItems.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engines.generation import Constraint

# Any JSON value, compact: what a schema that constrains nothing (or an object with no
# properties) stands for.
ANY_JSON_EBNF = r"""root ::= value
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" (string ":" value ("," string ":" value)*)? "}"
array ::= "[" (value ("," value)*)? "]"
string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]))* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
"""
ANY_OBJECT_EBNF = ANY_JSON_EBNF.replace("root ::= value", "root ::= object")
INTEGER_REGEX = r"-?(?:0|[1-9][0-9]*)"
NUMBER_REGEX = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
ARRAY_ITEMS_WRITTEN = 8
# A JSON string's characters as a regex: xgrammar's own JSON string grammar lets control characters
# through (measured: 9 of 40 sampled strings from the tiny model held one, which no JSON parser
# takes), and a negated class there matches single bytes, so invalid UTF-8 too; code point ranges
# are matched whole (0 of 40 invalid).
STRING_CHAR = r'(?:[ !#-\[\]-~]|[\u0080-\uffff]|\\["\\/bfnrt])'
LONGEST_COUNTED_STRING = 512  # maxLength above this goes to xgrammar's string grammar (a regex that
# counts so far grows too large)
ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
    "strict",
}
# Keywords a leaf may carry to xgrammar's JSON-schema converter (measured to compile), by type.
LEAF_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
}
STRING_FORMATS = {"date-time", "date", "time", "email", "uuid", "uri", "ipv4", "ipv6", "hostname"}
# Regex syntax xgrammar's converter refuses ("not supported yet"): lookarounds, group flags and
# named groups, backreferences, word boundaries and other anchors, Unicode classes.
UNSUPPORTED_ESCAPES = set("bBAZzGpPkK123456789")


class UnsupportedConstraint(ValueError):
    """A constraint this engine cannot take (the message says what and why)."""


def structured_output_config(ov_genai, constraint: Constraint):
    """The StructuredOutputConfig of a constraint; raises UnsupportedConstraint for what the engine
    cannot compile (checked without compiling it)."""
    config = ov_genai.StructuredOutputConfig
    if constraint.kind == "regex":
        check_regex(constraint.value)
        return config(regex=constraint.value)
    if constraint.kind == "grammar":
        raise UnsupportedConstraint(
            "openvino-genai takes no grammar here: a grammar its compiler fails on stops the whole batch, "
            "and only the compiler could check it first (use a JSON schema or a regex)"
        )
    schema = json.loads(constraint.value)
    return config(compound_grammar=CompactJSON(config, schema).grammar(schema))


def check_regex(pattern: str) -> None:
    """Refuse what xgrammar's regex converter would fail on, before it sees it."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise UnsupportedConstraint(f"not a regular expression: {exc}") from None
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            if pattern[i + 1] in UNSUPPORTED_ESCAPES:
                raise UnsupportedConstraint(
                    f"regex escape \\{pattern[i + 1]} at position {i} is not supported by openvino-genai (xgrammar)"
                )
            i += 2
            continue
        if char == "(" and pattern.startswith("?", i + 1) and not pattern.startswith("?:", i + 1):
            raise UnsupportedConstraint(
                f"regex group '(?{pattern[i + 2 : i + 3]}' at position {i} is not supported by openvino-genai "
                "(xgrammar takes plain and (?:...) groups only)"
            )
        i += 1


class CompactJSON:
    """A JSON schema as a compound grammar without whitespace between tokens (see the module doc)."""

    def __init__(self, config, root: Any):
        self.S, self.root = config, root

    def const(self, value) -> Any:
        return self.S.ConstString(json.dumps(value, separators=(",", ":"), ensure_ascii=False))

    def union(self, parts: list) -> Any:
        return parts[0] if len(parts) == 1 else self.S.Union(parts)

    def concat(self, parts: list) -> Any:
        return parts[0] if len(parts) == 1 else self.S.Concat(parts)

    def grammar(self, node: Any, seen: tuple = ()) -> Any:
        if node is True or node == {}:
            return self.S.EBNF(ANY_JSON_EBNF)
        if not isinstance(node, dict):
            raise UnsupportedConstraint(f"a schema must be an object or true, not {json.dumps(node)[:40]}")
        keys = set(node) - ANNOTATIONS
        if "$ref" in keys:
            return self.ref(node, keys, seen)
        if "const" in keys:
            return self.const(node["const"])
        if "enum" in keys:
            if not isinstance(node["enum"], list) or not node["enum"]:
                raise UnsupportedConstraint("'enum' must be a non-empty list")
            return self.union([self.const(v) for v in node["enum"]])
        for word in ("anyOf", "oneOf"):
            if word in keys:
                return self.alternatives(node, word, keys, seen)
        if "allOf" in keys:
            return self.all_of(node, keys, seen)
        kind = node.get("type")
        if isinstance(kind, list):
            return self.union([self.grammar({**node, "type": k}, seen) for k in kind])
        if kind is None:
            kind = "object" if keys & {"properties", "required", "additionalProperties"} else None
            if kind is None:
                self.refuse_unknown(keys, set())
                return self.S.EBNF(ANY_JSON_EBNF)
        return self.typed(node, kind, keys, seen)

    def typed(self, node: dict, kind, keys: set, seen: tuple) -> Any:
        if kind == "object":
            return self.object(node, keys, seen)
        if kind == "array":
            return self.array(node, keys, seen)
        if kind == "boolean":
            self.refuse_unknown(keys, {"type"})
            return self.S.Union([self.S.ConstString("true"), self.S.ConstString("false")])
        if kind == "null":
            self.refuse_unknown(keys, {"type"})
            return self.S.ConstString("null")
        if kind not in LEAF_KEYWORDS:
            raise UnsupportedConstraint(f"unknown JSON schema type {json.dumps(kind)[:40]}")
        self.refuse_unknown(keys, {"type"} | LEAF_KEYWORDS[kind])
        return self.leaf(node, kind, keys)

    def leaf(self, node: dict, kind: str, keys: set) -> Any:
        """A string or number, left to xgrammar's JSON-schema converter (no whitespace can appear
        in one), its keywords checked first; unbounded numbers as a regex (the converter's
        bounded-number grammar is the one measured to compile)."""
        if keys == {"type"} and kind in ("integer", "number"):
            return self.S.Regex(INTEGER_REGEX if kind == "integer" else NUMBER_REGEX)
        leaf = {k: node[k] for k in keys}
        for word in ("minLength", "maxLength"):
            if word in leaf and not (isinstance(leaf[word], int) and leaf[word] >= 0):
                raise UnsupportedConstraint(f"'{word}' must be a non-negative integer")
        if kind == "string" and keys <= {"type", "minLength", "maxLength"}:
            low, high = leaf.get("minLength", 0), leaf.get("maxLength")
            if high is not None and high < low:
                raise UnsupportedConstraint("'maxLength' is below 'minLength': no string fits")
            if high is None:
                return self.S.Regex(f'"{STRING_CHAR}{{{low},}}"')
            if high <= LONGEST_COUNTED_STRING:
                return self.S.Regex(f'"{STRING_CHAR}{{{low},{high}}}"')
        for word in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if word in leaf and (isinstance(leaf[word], bool) or not isinstance(leaf[word], (int, float))):
                raise UnsupportedConstraint(f"'{word}' must be a number")
        if "pattern" in leaf:
            if not isinstance(leaf["pattern"], str):
                raise UnsupportedConstraint("'pattern' must be a string")
            check_regex(leaf["pattern"])
        if "format" in leaf and leaf["format"] not in STRING_FORMATS:
            raise UnsupportedConstraint(
                f"string format {json.dumps(leaf['format'])[:40]} is not supported "
                f"(one of {', '.join(sorted(STRING_FORMATS))})"
            )
        return self.S.JSONSchema(json.dumps(leaf))

    def object(self, node: dict, keys: set, seen: tuple) -> Any:
        self.refuse_unknown(keys, {"type", "properties", "required", "additionalProperties"})
        properties = node.get("properties") or {}
        if not isinstance(properties, dict):
            raise UnsupportedConstraint("'properties' must be an object")
        required = node.get("required") or []
        if not isinstance(required, list) or not set(required) <= set(properties):
            raise UnsupportedConstraint("every name in 'required' must be one of the 'properties' here")
        if not properties:  # "properties": {} says no key is needed: "{}" is valid and ends
            if "properties" in node or node.get("additionalProperties") is False:
                return self.S.ConstString("{}")
            return self.S.EBNF(ANY_OBJECT_EBNF)
        parts = []
        for i, (name, schema) in enumerate(properties.items()):
            key = ("{" if i == 0 else ",") + json.dumps(name, ensure_ascii=False) + ":"
            parts += [self.S.ConstString(key), self.grammar(schema, seen)]
        return self.concat([*parts, self.S.ConstString("}")])

    def array(self, node: dict, keys: set, seen: tuple) -> Any:
        self.refuse_unknown(keys, {"type", "items", "minItems", "maxItems"})
        low, high = node.get("minItems", 0), node.get("maxItems")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise UnsupportedConstraint("'minItems' and 'maxItems' must be integers, minItems <= maxItems")
        high = low + ARRAY_ITEMS_WRITTEN if high is None else min(high, low + ARRAY_ITEMS_WRITTEN)
        item = self.grammar(node.get("items", True), seen)
        # Items beyond minItems, nested so that the grammar grows linearly: "]" or ",item" then the rest.
        rest = self.S.ConstString("]")
        for _ in range(high - low):
            rest = self.S.Union([self.S.ConstString("]"), self.S.Concat([self.S.ConstString(","), item, rest])])
        if low == 0:
            return self.S.Union([self.S.ConstString("[]"), self.S.Concat([self.S.ConstString("["), item, rest])])
        head = [self.S.ConstString("["), item]
        for _ in range(low - 1):
            head += [self.S.ConstString(","), item]
        return self.S.Concat([*head, rest])

    def ref(self, node: dict, keys: set, seen: tuple) -> Any:
        self.refuse_unknown(keys, {"$ref"})
        ref = node["$ref"]
        target = resolve_local_ref(self.root, ref)
        if target is None or ref in seen:
            raise UnsupportedConstraint(f"$ref {ref!r} is not a local, non-recursive reference")
        return self.grammar(target, (*seen, ref))

    def alternatives(self, node: dict, word: str, keys: set, seen: tuple) -> Any:
        self.refuse_unknown(keys, {word})
        options = node[word]
        if not isinstance(options, list) or not options:
            raise UnsupportedConstraint(f"'{word}' must be a non-empty list")
        return self.union([self.grammar(option, seen) for option in options])

    def all_of(self, node: dict, keys: set, seen: tuple) -> Any:
        self.refuse_unknown(keys, {"allOf"})
        if not isinstance(node["allOf"], list) or len(node["allOf"]) != 1:
            raise UnsupportedConstraint("'allOf' is taken with one schema only")
        return self.grammar(node["allOf"][0], seen)

    @staticmethod
    def refuse_unknown(keys: set, allowed: set) -> None:
        extra = sorted(keys - allowed)
        if extra:
            raise UnsupportedConstraint(f"the JSON schema keyword {extra[0]!r} is not supported here by openvino-genai")


def resolve_local_ref(root: Any, ref: str):
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node
