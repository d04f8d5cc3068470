"""benchmarks/serve_llm_apps.py's own pieces: the tool-call validation, a check's exception as its
failure and the table. The checks themselves run against real servers (on SmolLM2: docs/figures-history.md)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import serve_llm_apps as apps


def call(name: str, arguments) -> SimpleNamespace:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return SimpleNamespace(id="call_1", function=SimpleNamespace(name=name, arguments=text))


def test_tool_calls_validate_against_the_called_tools_schema():
    assert apps.validate_calls([call("get_weather", {"city": "Paris", "unit": "celsius"})])[0]
    assert apps.validate_calls([call("get_time", {"city": "Rome"})])[0]
    assert not apps.validate_calls([])[0]
    assert not apps.validate_calls([call("get_weather", {"city": "Paris", "unit": "kelvin"})])[0]
    assert not apps.validate_calls([call("get_weather", {"city": "Paris"})])[0]  # unit is required
    assert not apps.validate_calls([call("get_time", '{"city": "Ro')])[0]  # cut short
    assert not apps.validate_calls([call("launch", {})])[0]  # not one of the tools


def test_a_check_that_raises_is_a_failure_in_one_line(monkeypatch):
    def broken(ctx):
        raise ValueError("first line\nsecond line")

    monkeypatch.setitem(apps.CHECKS, "parse", broken)
    row = apps.run_check("parse", None)
    assert row == {"check": "parse", "passed": False, "figures": "ValueError: first line second line"}


def test_the_table_counts_what_passed():
    report = {
        "machine": {"date": "2026-12-02", "cpu": "AMD EPYC", "cores": 2},
        "engine": "openvino-genai",
        "artifact": "a",
        "checks": [
            {"check": "parse", "passed": True, "figures": "12 tokens"},
            {"check": "n", "passed": False, "figures": "1 choices"},
        ],
    }
    table = apps.markdown(report)
    assert "1/2 checks passed" in table.splitlines()[0]
    assert "| n | **failed** | 1 choices |" in table


def test_an_unknown_check_is_refused():
    with pytest.raises(SystemExit):
        apps.parse_args(["a", "--checks", "parse,nonsense"])
