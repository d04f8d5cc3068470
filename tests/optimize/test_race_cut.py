"""A build that overruns its budget is ended at the budget, not when it ends: the race's builds run in
processes of their own, the one cut is named in its outcome ("cut: over its N s build budget at N s"),
leaves nothing in the cache, and the race goes on with the others; the console says which candidate is
building and for how long against its budget, in one line."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from optimize import registry
from optimize.compile.race import budget as race_budget
from optimize.compile.race import build as race_build
from optimize.compile.race import candidates
from optimize.compile.race.entry import Entry
from optimize.context import Model


@dataclass
class _Seconds:
    seconds: float = 0.0


def _sleeps_then_builds(model: Model, cfg: _Seconds, ctx) -> Model:
    """An engine that takes `seconds` to build: a tiny ONNX graph, written after the wait."""
    import onnx
    from onnx import TensorProto, helper

    time.sleep(cfg.seconds)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    out = ctx.scratch / f"slow-{cfg.seconds}"
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), str(out / "model.onnx"))
    return model.with_onnx(out / "model.onnx").recorded({"method": "test_sleeps", "slept_s": cfg.seconds})


@pytest.fixture
def sleepy(monkeypatch):
    """Two candidates of a real registered engine: one quick, one that sleeps past any test budget."""
    method = registry.Method("engine", "test_sleeps", _Seconds, _sleeps_then_builds, input_format="torch")
    monkeypatch.setitem(registry._METHODS, ("engine", "test_sleeps"), method)
    monkeypatch.setitem(candidates.CANDIDATES, "slow", candidates.Candidate("test_sleeps", {"seconds": 600}))
    monkeypatch.setitem(candidates.CANDIDATES, "quick", candidates.Candidate("test_sleeps", {"seconds": 0}))


def _ctx(tmp_path):
    return SimpleNamespace(scratch=tmp_path / "scratch", threads=1, calibration=lambda: None, baseline=None)


def _race(tmp_path, cfg, names, key_base=None, stream=None):
    exported = Model(kind="onnx", task="generic")
    entries = [Entry(name, cfg.spec(name)) for name in names]
    budget = race_budget.Budget(cfg, entries, exported)
    line = race_build.ProgressLine(stream or io.StringIO(), tty=True)
    started = time.monotonic()
    race_build.build_all(entries, exported, _ctx(tmp_path), key_base, budget, line)
    return {e.name: e for e in entries}, time.monotonic() - started


def test_a_slow_build_is_cut_at_its_budget_and_the_race_goes_on(tmp_path, sleepy, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    cfg = candidates.EngineRaceConfig(candidates=["slow", "quick"], candidate_budget_s={"slow": 3, "quick": 60})
    stream = io.StringIO()
    by_name, took = _race(tmp_path, cfg, ["slow", "quick"], key_base="k" * 64, stream=stream)
    slow, quick = by_name["slow"], by_name["quick"]
    assert took < 3 + 30  # the 600 s build was ended at its 3 s budget, not waited for
    assert slow.model is None and slow.budget_cut and 3 <= slow.build_s < 3 + 2.5
    assert slow.outcome == "cut: over its 3 s build budget at 3 s"
    assert quick.model is not None and quick.model.onnx_path.is_file() and not quick.budget_cut
    assert quick.records["engine"]["slept_s"] == 0
    # The cut build left nothing in the cache: neither an entry nor a staging folder.
    race_root = tmp_path / "cache" / "race"
    left = sorted(p.name for p in race_root.iterdir()) if race_root.exists() else []
    assert left == [quick.model.onnx_path.parent.name]
    assert race_budget.fewer_than_asked(list(by_name.values())) == (
        "the winner is chosen from 1 of the 2 candidates asked for (cut by the build budget: slow)"
    )
    # The console: one line redrawn in place, naming the candidate and its time against its budget.
    said = stream.getvalue()
    assert "\n" not in said and "\r\x1b[Krace: building slow (1/2): 0 s of 3 s" in said
    assert "\r\x1b[Krace: building slow (1/2): 2 s of 3 s" in said


def test_the_race_budget_cuts_the_build_in_progress(tmp_path, sleepy):
    """time_budget_s=4 for candidates that may take 60 s each: the first is cut when the race's budget
    runs out, and the next never starts."""
    cfg = candidates.EngineRaceConfig(
        candidates=["slow", "quick"], time_budget_s=4, candidate_budget_s={"slow": 60, "quick": 60}
    )
    by_name, took = _race(tmp_path, cfg, ["slow", "quick"])
    assert took < 4 + 3
    assert by_name["slow"].outcome.startswith("cut: over the race's build budget (4 s, engine.params.time_budget_s)")
    assert by_name["quick"].outcome.startswith("not built: the race's build budget (4 s")
    assert not (tmp_path / "scratch" / "race" / "slow").exists()  # the cut one's scratch folder is gone


def test_a_build_that_raises_or_dies_is_recorded_and_the_race_goes_on():
    failed = race_build.run_bounded(lambda: {"x": 1 / 0}, 30, lambda s: None)
    assert failed["failed"] == "ZeroDivisionError: division by zero"
    import os

    died = race_build.run_bounded(lambda: os._exit(7), 30, lambda s: None)
    assert died["failed"] == "its build process ended with exit code 7"
    assert race_build.run_bounded(lambda: {"built": "here"}, 30, lambda s: None)["built"] == "here"


def test_a_partial_staging_folder_of_a_cut_build_is_removed(tmp_path):
    where = tmp_path / "race" / "abc"
    where.parent.mkdir(parents=True)
    mine, other = where.parent / ".abc.4242.x.tmp", where.parent / ".abc.99.y.tmp"
    mine.mkdir(), other.mkdir()
    race_build._discard_partial(where, "key", 4242)
    assert not mine.exists() and other.exists()  # another run's staging is not this build's to remove


def test_the_progress_line_in_a_log_is_written_once_a_minute_not_every_second():
    stream = io.StringIO()
    line = race_build.ProgressLine(stream, tty=False)
    for seconds in range(5):
        line.show(f"race: building a (1/2): {seconds} s of 150 s")
    line.show("race: building b (2/2): 0 s of 150 s")
    assert stream.getvalue().splitlines() == [
        "race: building a (1/2): 0 s of 150 s",
        "race: building b (2/2): 0 s of 150 s",
    ]


def test_the_race_table_says_which_build_was_cut_and_which_search_a_time_box_stopped():
    from optimize.reports.console import race_rows

    cut = Entry("ort_int8_dynamic", candidates.CANDIDATES["ort_int8_dynamic"], budget_cut=True, budget_s=150)
    cut.outcome = "cut: over its 150 s build budget at 150 s"
    boxed = Entry("openvino_mixed", candidates.CANDIDATES["openvino_mixed"], model=SimpleNamespace(precision="int8"))
    stopped = "stopped at its time box before any revert"
    boxed.records = {"engine": {"accuracy_control": {"stopped": stopped}}}
    boxed.outcome = "won: fastest"
    rows = race_rows({"candidates": [cut.report(), boxed.report()]})
    assert rows[1][0] == "ort_int8_dynamic" and rows[1][-1] == "cut: over its 150 s build budget at 150 s"
    assert rows[2][-1] == "won: fastest (its search stopped at its time box before any revert)"


def test_timing_the_budget_left_noisier_is_said_before_the_race_table():
    from optimize.reports.console import race_notes

    race = {"timing": {"budget_s": 300.0, "spent_s": 320.5, "retimes_cut": ["32"]}, "fewer_than_asked": "one of two"}
    assert race_notes(race) == [
        "NOTE: one of two",
        "NOTE: the machine was busy while timing batch 32 and the race's timing budget (300 s) left no time to "
        "time it again: those figures are noisier",
    ]
    assert race_notes({"timing": {"budget_s": 300.0, "spent_s": 60.0, "retimes_cut": []}}) == []
