"""What every protocol's request parser shares: the one strict JSON parse, and small typed getters
that refuse a wrong field with one clear message.

The parsers themselves live with their protocols (serve/protocols/kserve.py, serve/protocols/openai.py,
...): pure functions from bytes or decoded JSON to plain dataclasses. Each one either returns a request
the server can act on or raises HTTPError with a 4xx status: no other exception may escape, which
tests/serve/test_serve_fuzz.py checks with hypothesis on arbitrary input.

Checks that need the model (input names, dtypes, token ranges, prompt length) live with the model
(serve/encoder/model.py, serve/llm/model.py); the parsers enforce only the protocol's own schema.
"""

from __future__ import annotations

import math
from typing import Literal, overload

from engines.artifact import JSONInputError, parse_json
from serve.errors import bad_request


def load_json(body: bytes) -> object:
    """The one strict parse for JSON from outside (engines.artifact.parse_json): UTF-8 only, no lone
    surrogates (escaped or raw-encoded), integers of at most 64 digits, bounded nesting; else 400."""
    try:
        return parse_json(body)
    except JSONInputError as exc:
        raise bad_request(f"malformed JSON: {exc}") from None


def json_object(body: bytes) -> dict:
    data = load_json(body)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


# --- small typed getters: one clear message per wrong field --------------------------------------


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@overload
def get_str(data: dict, key: str, default: str) -> str: ...
@overload
def get_str(data: dict, key: str, default: None = None, *, required: Literal[True]) -> str: ...
@overload
def get_str(data: dict, key: str, default: None = None, required: bool = False) -> str | None: ...
def get_str(data: dict, key: str, default=None, required: bool = False) -> str | None:
    value = data.get(key, default)
    if value is None and not required:
        return default
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string", param=key)
    return value


def get_int(data: dict, key: str, default=None, low: int | None = None, high: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return default
    if not is_int(value):
        raise bad_request(f"'{key}' must be an integer", param=key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_request(f"'{key}' must be between {low} and {high}, got {value}", param=key)
    return value


def get_number(data: dict, key: str, default: float, low: float, high: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number", param=key)
    if not low <= value <= high:
        raise bad_request(f"'{key}' must be between {low:g} and {high:g}, got {value:g}", param=key)
    return float(value)


def get_object(data: dict, key: str, where: str = "") -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{where + ': ' if where else ''}'{key}' must be an object", param=key)
    return value


def get_bool(data: dict, key: str, default: bool = False) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be true or false", param=key)
    return value
