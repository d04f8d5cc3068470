"""Planning the race and its build budget: candidates refused before anything is built, the
race's seconds to build in, and the line that says when fewer candidates ran than were asked for."""

from __future__ import annotations

import logging
import time
from typing import Optional

from optimize.compile.race.candidates import (
    TIMING_BUDGET_FACTOR,
    EngineRaceConfig,
    default_candidates,
    parameter_count,
)
from optimize.compile.race.entry import Entry

log = logging.getLogger(__name__)


def refuse_at_plan_time(entries: list[Entry], model) -> None:
    """Candidates whose engine cannot take the model's architecture (engines/lm_archs.py), refused in
    one line each before anything is built."""
    from engines import lm_archs

    config = getattr(model.module, "config", None)
    if config is None:
        return
    for entry in entries:
        reason = lm_archs.refusal(entry.spec.engine, config)
        if reason:
            entry.refused = True
            entry.outcome = f"refused at plan time: {reason}"
            log.info("race: %s refused at plan time: %s", entry.name, reason)


def sized_candidates(cfg: EngineRaceConfig, model, generates: bool, gguf: bool) -> tuple[list[str], list[str]]:
    """The candidates to race and those the default set leaves out at this model's size (the cheapest
    builds kept, optimize/memory/plan.py): the names the recipe gave are all raced."""
    from optimize.memory import plan as memory

    if cfg.candidates:
        return list(cfg.candidates), []
    parameters = parameter_count(model)
    names = default_candidates(generates, gguf, parameters)
    builds = [memory.Build.of(name, cfg.spec(name)) for name in names]
    kept = {b.name for b in memory.cheapest_builds(builds, parameters)}
    left_out = [n for n in names if n not in kept]
    if left_out:
        log.info(
            "race: a model of %.2fB parameters races %d candidates by default; left out: %s",
            parameters / 1e9,
            len(kept),
            ", ".join(left_out),
        )
    return [n for n in names if n in kept], left_out


def refuse_for_memory(entries: list[Entry], model) -> None:
    """Candidates whose builder would need more memory than is free beside the loaded model, refused
    with the figure before anything is built (optimize/memory/plan.py)."""
    from optimize.memory import plan as memory

    parameters, free = parameter_count(model), memory.free_now()
    for entry in entries:
        if entry.refused:
            continue
        reason = memory.refusal(memory.Build.of(entry.name, entry.spec), parameters, free)
        if reason:
            entry.refused = True
            entry.outcome = reason
            log.warning("race: %s %s", entry.name, reason)


def refuse_unconstrained(entries: list[Entry], task) -> None:
    """serve.structured_output=true: candidates whose engine format cannot constrain output
    (engines/formats.py) are refused, one line each, before anything is built."""
    from engines import formats
    from optimize import registry

    for entry in entries:
        if entry.refused:
            continue
        made = registry.get("engine", entry.spec.engine).formats(None, task)
        if any(formats.get(name).constrains_output for name in made):
            continue
        reason = f"serve.structured_output=true, and {' or '.join(made) or 'its engine'} cannot constrain output"
        entry.refused = True
        entry.outcome = f"refused at plan time: {reason}"
        log.info("race: %s refused at plan time: %s", entry.name, reason)


class Budget:
    """The race's build budget: the recipe's time_budget_s, or the sum of the candidates' own budgets
    (candidate_budget_s, else scaled by the model's size). Counted from the first build; a candidate
    starts only while some is left, and builds (in a process of its own, race/build.py) for its own
    budget or what is left of the race's, whichever is less: when that runs out its build is ended
    and the candidate is cut, said in its outcome; the race goes on with the others."""

    def __init__(self, cfg: EngineRaceConfig, entries: list[Entry], model):
        for entry in entries:
            entry.budget_s = cfg.budget_of(entry.name, model)
        self.per_candidate = cfg.time_budget_s is None
        planned = [e for e in entries if not e.refused]
        self.total_s = cfg.time_budget_s if cfg.time_budget_s is not None else sum(e.budget_s for e in planned)
        self.started = time.monotonic()

    def spent(self) -> bool:
        return self.left_s() <= 0

    def left_s(self) -> float:
        return self.total_s - (time.monotonic() - self.started)

    def limit_for(self, entry: Entry) -> tuple[float, str]:
        """(seconds `entry` may build for, the budget that sets them as its outcome names it): its own
        budget, or what is left of the race's when that is less."""
        own = f"its {entry.budget_s:.0f} s build budget"
        left = self.left_s()
        if left < entry.budget_s:
            return left, f"{self.describe()}, {max(left, 0):.0f} s of it left when it started"
        return entry.budget_s, own

    def describe(self) -> str:
        kind = "the sum of the candidates' budgets" if self.per_candidate else "engine.params.time_budget_s"
        return f"the race's build budget ({self.total_s:.0f} s, {kind})"

    def note(self, entry: Entry) -> None:
        if entry.model is not None and not entry.cached and entry.build_s > entry.budget_s:
            entry.over_budget = True
            log.warning(
                "race: %s took %.0f s to build, over its %.0f s budget", entry.name, entry.build_s, entry.budget_s
            )

    def record(self, entries: list[Entry]) -> dict:
        return {
            "total_s": round(self.total_s, 1),
            "from": "candidate budgets" if self.per_candidate else "time_budget_s",
            "per_candidate_s": {e.name: round(e.budget_s, 1) for e in entries},
            "build_s": {e.name: round(e.build_s, 1) for e in entries if e.model is not None},
            "cut": [e.name for e in entries if e.budget_cut],
            "over_budget": [e.name for e in entries if e.over_budget],
        }


class TimingBudget:
    """The race's timing phase (encoders): seconds to time every built candidate at every workload
    point, counted from the first timed run. Each point's runs share what is left evenly; a point timed
    while the machine was busy is timed again only while that fits (benchmark.quietest), so a busy
    machine costs the figures' quality, said in the record, not an unbounded wait."""

    MEASURE_S = 8.0  # at most this many seconds of timed calls per runner and point

    def __init__(self, cfg: EngineRaceConfig, entries: list[Entry]):
        longest = max(e.budget_s for e in entries)
        self.total_s = cfg.timing_budget_s if cfg.timing_budget_s is not None else TIMING_BUDGET_FACTOR * longest
        self.given = cfg.timing_budget_s is not None
        self.started = time.monotonic()
        self.finished: Optional[float] = None
        self.cut_points: list[str] = []

    def end(self) -> float:
        return self.started + self.total_s

    def spent_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def finish(self) -> None:
        self.finished = time.monotonic()
        if self.cut_points:
            log.warning(
                "race: the timing budget (%.0f s) left no time to time again, on a busy machine, the points %s",
                self.total_s,
                ", ".join(self.cut_points),
            )

    def measure_s(self, points_left: int, runners: int) -> float:
        """Seconds of timed calls each runner gets at the next point (benchmark.measure's budget_s)."""
        left = max(0.0, self.end() - time.monotonic())
        return min(self.MEASURE_S, left / max(points_left, 1) / max(runners, 1))

    def record(self) -> dict:
        return {
            "budget_s": round(self.total_s, 1),
            "from": "timing_budget_s" if self.given else f"{TIMING_BUDGET_FACTOR:g}x the longest build budget",
            "spent_s": round(self.spent_s(), 1),
            "retimes_cut": self.cut_points,
        }


def fewer_than_asked(entries: list[Entry]) -> Optional[str]:
    """One line when the winner is chosen from fewer candidates than the recipe asked for, naming why."""
    built = [e for e in entries if e.model is not None]
    if len(built) == len(entries):
        return None
    missing = [e for e in entries if e.model is None]
    reasons = {
        "cut by the build budget": [e.name for e in missing if e.budget_cut],
        "refused for memory": [e.name for e in missing if e.outcome.startswith("refused for memory")],
        "refused at plan time": [e.name for e in missing if e.refused and not e.outcome.startswith("refused for")],
        "failed to build": [e.name for e in missing if not e.budget_cut and not e.refused],
    }
    said = "; ".join(f"{why}: {', '.join(names)}" for why, names in reasons.items() if names)
    return f"the winner is chosen from {len(built)} of the {len(entries)} candidates asked for ({said})"


def say_if_fewer(entries: list[Entry], built: list[Entry]) -> None:
    line = fewer_than_asked(entries)
    if line and built:
        log.warning("race: %s", line)
