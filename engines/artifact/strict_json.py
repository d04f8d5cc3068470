"""JSON from outside, parsed strictly: the one parse for manifests and request bodies (serve/ uses it
for every body it reads)."""

from __future__ import annotations

import json
import re

MAX_JSON_INT_DIGITS = 64  # no field here needs more; Python refuses over 4300 digits with a ValueError


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONG_DIGITS = re.compile(r"[0-9]{%d}" % (MAX_JSON_INT_DIGITS + 1))


class JSONInputError(ValueError):
    """Text from outside that is not JSON this project accepts; the message is one line."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise JSONInputError(f"an integer of {len(text)} characters (at most {MAX_JSON_INT_DIGITS} digits)")
    return int(text)


def _check_strings(value) -> None:
    """Every string (key or value) must be encodable as UTF-8: a JSON escape can spell a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise JSONInputError("a string is not valid UTF-8 (a lone surrogate)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_json(data: bytes | str) -> object:
    """JSON from a file or a request, parsed strictly: UTF-8 only (raw surrogate bytes included, which
    `json.loads(bytes)` lets through), integers of at most MAX_JSON_INT_DIGITS digits, no lone
    surrogates, bounded nesting. NaN and Infinity stay readable (callers that take numbers check them).
    Anything else is a JSONInputError with one line."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        # The integer hook runs in Python once per integer (4x slower on a body of 12k integers):
        # only text holding a run of digits longer than the bound needs it.
        hook = _bounded_int if _LONG_DIGITS.search(text) else None
        value = json.loads(text, parse_int=hook)
    except UnicodeDecodeError as exc:
        raise JSONInputError(f"not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise JSONInputError(" ".join(str(exc).split())[:200]) from None
    except RecursionError:
        raise JSONInputError("nested too deeply") from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape can spell a lone surrogate: walk only then
        _check_strings(value)
    return value
