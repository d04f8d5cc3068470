"""Fuzzing the labeled data source (`evaluate.data.source=labeled`) with hostile files: every one is
read or refused with one DataError line (what `python -m optimize` prints with exit 2); never another
exception (exit 3). In process, so a couple of hundred files take seconds."""

from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import calibration  # noqa: E402

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
)
ROW = st.dictionaries(st.sampled_from(["text", "label", "tokens", "x"]), VALUES, max_size=4)
LINE = st.one_of(ROW.map(json.dumps), st.text(max_size=60), st.binary(max_size=40).map(lambda b: b.decode("latin-1")))


def read(path, **kw):
    """The source's answer: a TextSet, or the one line `python -m optimize` would print."""
    try:
        return calibration.load("labeled", "evaluation", 1, 0, path=str(path), dataset_split="all", **kw)
    except calibration.DataError as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)
        return message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINE, max_size=6), suffix=st.sampled_from([".jsonl", ".json", ".csv"]))
def test_any_file_is_read_or_refused_in_one_line(lines, suffix, tmp_path):
    path = tmp_path / f"data{suffix}"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    read(path)
    read(path, field="tokens", label_field="x")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_any_bytes_are_read_or_refused_in_one_line(raw, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(raw)
    read(path)
