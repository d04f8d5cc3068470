"""ONNX external data, read from the protobuf here (not left to onnx or ONNX Runtime): where every
tensor's data lives, and that those files stay beside the graph."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from .errors import ArtifactError
from .files import check_regular_file, contained


def _varint(buf, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, value or (start, end) of a length-delimited field)."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise ValueError("truncated field")
            yield number, wire, (pos, pos + size)
            pos += size
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != end:
        raise ValueError("truncated message")


# Which length-delimited fields of which message hold which messages (onnx.proto3).
_CHILDREN = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "function": {7: "node"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
}


def onnx_external_locations(path: Path) -> list[str]:
    """The external-data `location` of every tensor in an ONNX file (subgraphs included)."""
    locations: list[str] = []
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ArtifactError(f"{path} is empty, not an ONNX model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                _collect(buf, 0, len(buf), "model", locations, 0)
            except (ValueError, IndexError, RecursionError) as exc:
                raise ArtifactError(f"{path} is not a valid ONNX model ({exc})") from None
    return locations


def _collect(buf, start: int, end: int, kind: str, out: list[str], depth: int) -> None:
    if depth > 64:
        raise ValueError("nested too deeply")
    if kind == "tensor":
        for number, wire, value in _fields(buf, start, end):
            if number == 13 and wire == 2:  # external_data: StringStringEntryProto {key=1, value=2}
                entry = {
                    n: bytes(buf[v[0] : v[1]]).decode("utf-8", "replace") for n, w, v in _fields(buf, *value) if w == 2
                }
                if entry.get(1) == "location":
                    out.append(entry.get(2, ""))
        return
    children = _CHILDREN[kind]
    for number, wire, value in _fields(buf, start, end):
        if wire == 2 and number in children:
            _collect(buf, value[0], value[1], children[number], out, depth + 1)


def check_onnx_external_data(model: Path) -> list[Path]:
    """The external-data files of an ONNX graph, each refused unless it is a regular single-link file in
    the graph's own folder tree, reached through no symbolic link and no `..` (so a graph inside an
    artifact never reads outside it)."""
    files = []
    for location in sorted(set(onnx_external_locations(model))):
        what = f"{model.name}: external data location"
        path = contained(model.parent, location, what)
        check_regular_file(path, f"{what} {location!r}")
        files.append(path)
    return files
