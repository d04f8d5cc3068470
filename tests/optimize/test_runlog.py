"""Quiet by default: a run's console shows this tool's lines, the tables and the verdict; library
warnings and INFO lines are kept in the run's log inside the artifact (run.log); -v shows everything."""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings

import pytest

from optimize import runlog
from tests.support.cli import one_error_line, run_optimize


def _record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setitem(runlog._state, "verbose", False)
    monkeypatch.setattr(runlog.RUN_LOG, "lines", [])


def test_the_console_shows_this_tools_lines_errors_and_warnings_that_are_not_noise(quiet, monkeypatch):
    shows = runlog.CONSOLE.filter
    assert shows(_record("optimize.pipeline", logging.INFO, "engine: auto"))
    assert not shows(_record("optimize.compile.auto", logging.DEBUG, "race: ort_fp32 lost"))  # the table repeats it
    assert not shows(_record("nncf", logging.INFO, "Validation of initial model was started"))
    assert shows(_record("nncf", logging.WARNING, "a library warning that is not known noise"))
    assert not shows(_record("root", logging.WARNING, "Please consider to run pre-processing before quantization."))
    exporter = "torch.onnx._internal.exporter._registration"
    assert not shows(_record(exporter, logging.WARNING, "torchvision is not installed. Skipping torchvision::nms"))
    assert shows(_record("root", logging.ERROR, "Please consider to run pre-processing before quantization."))
    monkeypatch.setitem(runlog._state, "verbose", True)
    assert shows(_record("nncf", logging.INFO, "Validation of initial model was started"))
    assert shows(_record("optimize.compile.auto", logging.DEBUG, "race: ort_fp32 lost"))


def test_library_warnings_go_to_the_log_and_numerical_ones_to_the_console_too(quiet, capsys):
    runlog._showwarning(FutureWarning("`LeafSpec` is deprecated"), FutureWarning, "/site-packages/x.py", 3)
    runlog._showwarning(RuntimeWarning("invalid value in divide"), RuntimeWarning, "/site-packages/y.py", 4)
    own = runlog.OWN_PACKAGES[0] + "/stage.py"
    runlog._showwarning(UserWarning("said to the user"), UserWarning, own, 5)
    err = capsys.readouterr().err
    assert "LeafSpec" not in err and "invalid value in divide" in err and "said to the user" in err
    kept = "\n".join(runlog.RUN_LOG.lines)
    assert "FutureWarning: `LeafSpec` is deprecated" in kept and "RuntimeWarning" in kept and "said to" in kept
    with warnings.catch_warnings():  # the function warnings.warn calls, as installed
        warnings.simplefilter("always")
        warnings.showwarning = runlog._showwarning
        warnings.warn("through warnings.warn", DeprecationWarning, stacklevel=1)
    assert "through warnings.warn" in runlog.RUN_LOG.lines[-1] and capsys.readouterr().err == ""


def test_progress_bars_drawn_into_the_log_stream_are_kept_line_by_line(quiet):
    stream = runlog._LogStream("rich")
    stream.write("Statistics collection ━━━ 100% 64/64\nApplying Fast Bias")
    stream.write(" correction ━━━ 100% 12/12\n\n")
    assert [line.split(" - ", 1)[1] for line in runlog.RUN_LOG.lines] == [
        "Statistics collection ━━━ 100% 64/64",
        "Applying Fast Bias correction ━━━ 100% 12/12",
    ]


@pytest.mark.slow
def test_a_run_prints_the_report_and_keeps_library_lines_in_the_artifact(minilm_run):
    stdout, stderr = minilm_run.proc.stdout, minilm_run.proc.stderr
    lines = stdout.splitlines()
    before_report = lines[: next(i for i, line in enumerate(lines) if line.startswith("recipe "))]
    assert len(before_report) <= 3 and "engine: onnx" in before_report[0], stdout  # a line per stage
    assert "gate: PASSED" in stdout and "artifact: " in lines[-1]
    assert stderr.strip() == "", stderr  # no library warning, no torch exporter notice
    log = (minilm_run.artifact / runlog.LOG_FILE).read_text()
    assert "[optimize.pipeline][INFO] - engine: onnx" in log
    assert "[root][WARNING] - Please consider to run pre-processing before quantization" in log  # ONNX Runtime
    if importlib.util.find_spec("torchvision") is None:
        assert "torchvision is not installed" in log  # torch's exporter, on its own logger
    manifest = json.loads((minilm_run.artifact / "manifest.json").read_text())
    assert runlog.LOG_FILE in {f["path"] for f in manifest["files"]}


@pytest.mark.slow
def test_verbose_is_a_flag_of_this_tool_and_errors_stay_one_line(tmp_path):
    one_error_line(run_optimize("-v", "gate.nonexistent=1", f"hydra.run.dir={tmp_path}"), "nonexistent")
