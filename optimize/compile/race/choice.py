"""Choosing the race's winner, the same way for every task: a candidate that fails any accuracy or
size check of the gate is never shipped, however fast; among those that pass, the lowest cost wins;
when none passes, the most accurate ships so the gate fails on a real artifact.

Over a workload of several points (batch sizes, request shapes) the cost is the weighted one, and two
rules keep one point from deciding alone: a candidate slower than the baseline at any point cannot win
while a passing candidate that is not exists, and among the candidates whose cost is within
COST_NOISE of the lowest, the most balanced wins (the smallest worst ratio to the best figure at any
point). Candidates that close to the winner yet more than POINT_GAP apart at some point are named.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Optional

from optimize.compile.race.entry import Entry

# Costs this close are one measurement apart on a shared machine: block-alternating p50s of the same
# runner moved by a few percent between runs.
COST_NOISE = 0.05
# A gap at one point worth naming in the report.
POINT_GAP = 0.10


def untimed_thresholds(gate_thresholds: dict) -> dict[str, Any]:
    """The gate's thresholds the race can judge before the final evaluation (not timing, not memory)."""
    from optimize import gate

    return {k: v for k, v in gate_thresholds.items() if k in gate.untimed_keys() and k != "max_peak_memory_mb"}


def pick(
    entries: list,
    thresholds: dict,
    measured: Callable,
    cost: Callable,
    error: Callable,
    cost_words: tuple[str, str],
    per_point: Optional[Callable[[Any], dict[str, float]]] = None,
    baseline: Optional[dict[str, float]] = None,
):
    """The winner among `entries` (each gets accuracy_checks, passed and outcome), judged on the
    gate's `thresholds` the race can check (untimed_thresholds).

    measured(entry) -> the metrics the gate reads; cost(entry) -> what the winner minimises;
    error(entry) -> how far from the baseline it is (the most accurate ships when none passes);
    cost_words: ("fastest at batch 1", "p50 at batch 1"), how the outcome lines name the cost;
    per_point(entry) -> {"batch 32": ms, ...}, its time at each workload point (lower is better), and
    baseline: the baseline's at the same points (each entry's slower_than_baseline_at is set)."""
    from optimize import gate

    for entry in entries:
        verdict = gate.judge({}, {**measured(entry), "size_mb": entry.size_mb}, thresholds)
        entry.accuracy_checks = [asdict(c) for c in verdict.checks]
        entry.passed = verdict.passed
    points = per_point or (lambda e: {})
    base = baseline or {}
    for entry in entries:
        entry.slower_than_baseline_at = [k for k, v in points(entry).items() if k in base and v > base[k]]
    passing = sorted((e for e in entries if e.passed), key=cost)
    if not passing:
        best = min(entries, key=error)
        for entry in entries:
            entry.outcome = "failed accuracy" + ("; shipped as the most accurate" if entry is best else "")
        return best
    never_slower = [e for e in passing if not e.slower_than_baseline_at]
    winner = _balanced(never_slower or passing, cost, points)
    several = len(points(winner)) > 1
    for entry in entries:
        entry.outcome = _outcome(entry, winner, passing, cost, points, cost_words, several)
    return winner


def _balanced(pool: list, cost: Callable, points: Callable):
    """The candidate with the smallest worst ratio to the best time at any point, among those whose
    cost is within COST_NOISE of the lowest (with one point: simply the lowest cost)."""
    lowest = cost(pool[0])
    near = [e for e in pool if cost(e) <= lowest * (1 + COST_NOISE)]
    best = {k: min(points(e)[k] for e in pool) for k in points(pool[0])}

    def worst_ratio(entry) -> float:
        return max((v / best[k] for k, v in points(entry).items() if best[k] > 0), default=1.0)

    if len(best) <= 1:
        return pool[0]
    return min(near, key=lambda e: (worst_ratio(e), cost(e)))


def _outcome(entry, winner, passing: list, cost, points, cost_words: tuple[str, str], several: bool) -> str:
    best_words, cost_name = cost_words
    if entry is winner:
        won = f"won: {best_words} of the {len(passing)} that pass accuracy"
        if several and entry.slower_than_baseline_at:
            won += f"; slower than the baseline at {', '.join(entry.slower_than_baseline_at)}, as every passing one"
        return won
    if not entry.passed:
        failed = [c["name"] for c in entry.accuracy_checks if not c["passed"]]
        return f"lost: failed accuracy ({', '.join(failed)})"
    if several and entry.slower_than_baseline_at and not winner.slower_than_baseline_at:
        return f"lost: slower than the baseline at {', '.join(entry.slower_than_baseline_at)}"
    lost = f"lost: {cost(entry) / cost(winner):.2f}x the winner's {cost_name}"
    return lost + _gap(entry, winner, cost, points) if several else lost


def _gap(entry, winner, cost, points) -> str:
    """Within noise of the winner's cost yet more than POINT_GAP apart at some point: say where."""
    if cost(entry) > cost(winner) * (1 + COST_NOISE):
        return ""
    mine, theirs = points(entry), points(winner)
    gaps = [(k, mine[k] / theirs[k]) for k in mine if theirs.get(k)]
    wide = [(k, r) for k, r in gaps if r > 1 + POINT_GAP or r < 1 / (1 + POINT_GAP)]
    if not wide:
        return ""
    where = ", ".join(f"{r:.2f}x the winner's time at {k}" for k, r in wide)
    return f"; within {COST_NOISE:.0%} of the winner's cost (within noise) but {where}"


def choose(entries: list[Entry], workload, baseline_p50: dict, thresholds: dict) -> Entry:
    """The fastest over the workload (p50 at its one batch size, or the weighted p50 over several)
    among the candidates that pass every accuracy (and size) check of the gate, preferring those
    never slower than the baseline at any point."""
    points = workload.batches
    if len(points) == 1:
        batch = points[0].key
        words = (f"fastest at batch {batch}", f"p50 at batch {batch}")
    else:
        for entry in entries:
            entry.cost = sum(p.weight * entry.latency[p.key]["p50_ms"] for p in points)
        mix = ", ".join(f"batch {p.batch}: {p.weight:.2f}" for p in points)
        words = (f"fastest over the workload ({mix})", "weighted p50")
    return pick(
        entries,
        thresholds,
        measured=lambda e: {"fidelity": e.fidelity, **e.scores},
        cost=lambda e: e.cost if e.cost is not None else e.latency[points[0].key]["p50_ms"],
        error=lambda e: -e.fidelity.get("cosine_min", 0.0),
        cost_words=words,
        per_point=lambda e: {f"batch {p.batch}": e.latency[p.key]["p50_ms"] for p in points},
        baseline={f"batch {p.batch}": baseline_p50[p.key] for p in points},
    )


def won_on(workload, lm: bool) -> str:
    """What the race minimised, in words."""
    if lm:
        points = workload.requests
        shapes = ", ".join(f"{p.key}: {p.weight:.2f}" for p in points)
        levels = ", ".join(f"{c.clients} clients: {c.weight:.2f}" for c in workload.concurrency)
        return f"served request time over the best candidate's, by level ({levels}) and shape ({shapes})"
    if len(workload.batches) == 1:
        return f"p50 at batch {workload.batches[0].batch}"
    return "weighted p50 (" + ", ".join(f"batch {p.batch}: {p.weight:.2f}" for p in workload.batches) + ")"
