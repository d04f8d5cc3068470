"""JSON response bodies, with numpy arrays written directly.

The stdlib encoder writes each float through Python's float repr: 384 embedding values cost about
0.45 ms on the 2-core benchmark machine, a fifth of the server's whole overhead per request.
orjson (in the `serve` extra, 0.3 MB) writes a float32 array in about 0.02 ms, each value as its
shortest float32 repr (which reads back to the identical float32; the stdlib path writes the
float64 widening of the same value, 17 digits). Without orjson the stdlib path is used, so the
server still works where it is not installed.
"""

from __future__ import annotations

import json

import numpy as np
from starlette.responses import JSONResponse

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by test_serve_jsonbody with orjson hidden
    orjson = None  # type: ignore[assignment]

# Array dtypes orjson writes natively (OPT_SERIALIZE_NUMPY); others go through tolist().
NATIVE = {
    np.dtype(t)
    for t in ("float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool")
}


def plain(value):
    """numpy values the encoder cannot write natively, as Python ones."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(content) -> bytes:
    """Compact UTF-8 JSON; numpy arrays and scalars are written as lists and numbers."""
    if orjson is not None:
        try:
            return orjson.dumps(content, default=plain, option=orjson.OPT_SERIALIZE_NUMPY)
        except orjson.JSONEncodeError as exc:
            raise ValueError(str(exc)) from None
    return json.dumps(content, default=plain, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def array(value: np.ndarray):
    """An array as the JSON encoder wants it: C-contiguous and of a dtype it writes natively
    (then it stays an array, written without a Python float per element), else a nested list.

    Not-a-number and infinities are refused (ValueError, so a 500), as the stdlib encoder with
    allow_nan=False refuses them: JSON has no such values (orjson would write null).
    """
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise ValueError("the model returned values that are not finite (NaN or infinity)")
    if orjson is not None and value.dtype in NATIVE:
        if value.dtype.byteorder == ">":
            value = value.astype(value.dtype.newbyteorder("<"))
        return np.ascontiguousarray(value)
    return value.tolist()


class FastJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return dumps(content)
