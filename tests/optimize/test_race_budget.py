"""The race's build budget: per candidate (the recipe's, else scaled by the model's size), summed into the
race's unless the recipe sets time_budget_s; what it cut, and how long each build took, in the report;
and the winner never chosen from fewer candidates than asked without the report saying so first."""

from __future__ import annotations

import json
import time

import pytest

from optimize.compile.race import budget as race_budget
from optimize.compile.race import candidates, cells
from optimize.compile.race.entry import Entry
from optimize.errors import RecipeError
from tests.support.cli import TINY_LM_RACE, run_optimize


class _Sized:
    """A model whose module has `n` parameters (as torch reports them)."""

    class _Param:
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

    def __init__(self, n: int):
        self.module = self
        self._n = n

    def parameters(self):
        return [self._Param(self._n)]


def test_the_default_budget_scales_with_the_model():
    assert candidates.scaled_budget_s(_Sized(1_000_000)) == candidates.MIN_CANDIDATE_BUDGET_S
    small, large = candidates.scaled_budget_s(_Sized(135_000_000)), candidates.scaled_budget_s(_Sized(270_000_000))
    assert large == pytest.approx(2 * small) and small == pytest.approx(candidates.BUDGET_S_PER_100M_PARAMS * 1.35)


def test_a_recipe_sets_the_budget_per_candidate():
    cfg = candidates.EngineRaceConfig(
        candidates=["ort_fp32", "openvino_f32"], candidate_budget_s={"ort_fp32": 20, "default": 5}
    )
    cfg.validate()
    model = _Sized(10)
    assert cfg.budget_of("ort_fp32", model) == 20 and cfg.budget_of("openvino_f32", model) == 5
    assert candidates.EngineRaceConfig().budget_of("ort_fp32", model) == candidates.MIN_CANDIDATE_BUDGET_S
    with pytest.raises(RecipeError, match="candidate_budget_s names \\['ort_int8_static'\\]"):
        candidates.EngineRaceConfig(candidates=["ort_fp32"], candidate_budget_s={"ort_int8_static": 5}).validate()
    with pytest.raises(RecipeError, match="positive number of seconds"):
        candidates.EngineRaceConfig(candidate_budget_s={"default": 0}).validate()


def _entries(*names):
    return [Entry(name, candidates.CANDIDATES[name]) for name in names]


def test_the_budget_sums_the_candidates_and_names_what_it_cut():
    entries = _entries("ort_fp32", "ort_int8_dynamic", "openvino_f32")
    cfg = candidates.EngineRaceConfig(candidate_budget_s={"default": 0.05})
    budget = race_budget.Budget(cfg, entries, _Sized(10))
    assert budget.total_s == pytest.approx(0.15) and "sum of the candidates' budgets" in budget.describe()
    first = entries[0]
    first.model, first.build_s = object(), 0.2  # built, over its own 0.05 s
    budget.note(first)
    time.sleep(0.2)
    assert budget.spent()
    for entry in entries[1:]:
        entry.budget_cut = True
    record = budget.record(entries)
    assert record["cut"] == ["ort_int8_dynamic", "openvino_f32"] and record["over_budget"] == ["ort_fp32"]
    assert record["build_s"] == {"ort_fp32": 0.2}
    assert race_budget.fewer_than_asked(entries) == (
        "the winner is chosen from 1 of the 3 candidates asked for "
        "(cut by the build budget: ort_int8_dynamic, openvino_f32)"
    )
    assert cells.build_words(first) == "0 (over 0)"
    fixed = race_budget.Budget(candidates.EngineRaceConfig(time_budget_s=60), entries, _Sized(10))
    assert fixed.total_s == 60 and "time_budget_s" in fixed.describe()


def test_nothing_is_said_when_every_candidate_was_built():
    entries = _entries("ort_fp32", "openvino_f32")
    for entry in entries:
        entry.model = object()
    assert race_budget.fewer_than_asked(entries) is None


@pytest.mark.slow
def test_a_race_cut_by_its_budget_says_so_before_the_winner(tmp_path):
    """A budget of 1 s for two of three candidates: their builds are ended at 1 s and cut, the race
    goes on with the third, and the report's first words about the race say the winner came from one
    of three."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("openvino_genai")
    from tests.support.models import tiny_llama_folder

    source = tiny_llama_folder(tmp_path / "src")
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={source}",
        *TINY_LM_RACE,
        "engine.params.candidates=[ort_genai_int4,openvino_genai_int8,openvino_genai_int4_g32]",
        "+engine.params.candidate_budget_s.default=1",
        "+engine.params.candidate_budget_s.ort_genai_int4=600",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    race = json.loads((out / "manifest.json").read_text())["stages"]["engine"]
    assert race["budget"]["cut"] == ["openvino_genai_int8", "openvino_genai_int4_g32"]
    assert race["budget"]["over_budget"] == [] and race["budget"]["total_s"] == 602
    assert race["fewer_than_asked"].startswith("the winner is chosen from 1 of the 3 candidates")
    # Said before the winner is: in the log as the builds end, and in the report above the race table.
    said = "the winner is chosen from 1 of the 3 candidates asked for (cut by the build budget"
    assert proc.stdout.index(said) < proc.stdout.index("won:")
    report = proc.stdout[proc.stdout.index("engine race (") :]
    assert report.index(f"NOTE: {said}") < report.index("won:") and "build s" in report
    by_name = {c["name"]: c for c in race["candidates"]}
    assert by_name["openvino_genai_int8"]["outcome"].startswith("cut: over its 1 s build budget at ")


def test_the_timing_budget_is_twice_the_longest_build_budget_and_its_points_share_what_is_left():
    entries = _entries("ort_fp32", "openvino_f32", "openvino_mixed")
    cfg = candidates.EngineRaceConfig(candidate_budget_s={"default": 100, "openvino_mixed": 150})
    race_budget.Budget(cfg, entries, _Sized(10))  # gives each entry its build budget
    timing = race_budget.TimingBudget(cfg, entries)
    assert timing.total_s == candidates.TIMING_BUDGET_FACTOR * 150
    # 300 s over 2 points and 10 runners would be 15 s each: capped at the most one runner needs.
    assert timing.measure_s(points_left=2, runners=10) == race_budget.TimingBudget.MEASURE_S
    given = race_budget.TimingBudget(candidates.EngineRaceConfig(timing_budget_s=0.4), entries)
    assert given.measure_s(points_left=2, runners=2) == pytest.approx(0.1, abs=0.01)
    time.sleep(0.4)
    given.cut_points.append("32")
    given.finish()
    assert given.measure_s(points_left=1, runners=2) == 0.0  # spent: the fewest repeats
    record = given.record()
    assert record["budget_s"] == 0.4 and record["from"] == "timing_budget_s" and record["retimes_cut"] == ["32"]
    assert record["spent_s"] >= 0.4
    with pytest.raises(RecipeError, match="timing_budget_s must be positive"):
        candidates.EngineRaceConfig(timing_budget_s=0).validate()
