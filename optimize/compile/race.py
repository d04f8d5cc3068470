"""Choosing the race's winner, the same way for every task: a candidate that fails any accuracy or
size check of the gate is never shipped, however fast; among those that pass, the lowest cost wins;
when none passes, the most accurate ships so the gate fails on a real artifact."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable


def untimed_thresholds(ctx) -> dict[str, Any]:
    """The gate's thresholds the race can judge before the final evaluation (not timing, not memory)."""
    from optimize import gate
    from optimize.config import recipe_dict

    return {
        k: v for k, v in recipe_dict(ctx.cfg.gate).items() if k in gate.untimed_keys() and k != "max_peak_memory_mb"
    }


def pick(entries: list, ctx, measured: Callable, cost: Callable, error: Callable, cost_words: tuple[str, str]):
    """The winner among `entries` (each gets accuracy_checks, passed and outcome).

    measured(entry) -> the metrics the gate reads; cost(entry) -> what the winner minimises;
    error(entry) -> how far from the baseline it is (the most accurate ships when none passes);
    cost_words: ("fastest at batch 1", "p50 at batch 1"), how the outcome lines name the cost."""
    from optimize import gate

    thresholds = untimed_thresholds(ctx)
    for entry in entries:
        verdict = gate.judge({}, {**measured(entry), "size_mb": entry.size_mb}, thresholds)
        entry.accuracy_checks = [asdict(c) for c in verdict.checks]
        entry.passed = verdict.passed
    passing = sorted((e for e in entries if e.passed), key=cost)
    if not passing:
        best = min(entries, key=error)
        for entry in entries:
            entry.outcome = "failed accuracy" + ("; shipped as the most accurate" if entry is best else "")
        return best
    winner, (best_words, cost_name) = passing[0], cost_words
    for entry in entries:
        if entry is winner:
            entry.outcome = f"won: {best_words} of the {len(passing)} that pass accuracy"
        elif not entry.passed:
            failed = [c["name"] for c in entry.accuracy_checks if not c["passed"]]
            entry.outcome = f"lost: failed accuracy ({', '.join(failed)})"
        else:
            entry.outcome = f"lost: {cost(entry) / cost(winner):.2f}x the winner's {cost_name}"
    return winner
