"""Latency harness: warm-up, then runners timed in alternation on the same batches.

Alternating the runners round by round spreads slow phases of a shared machine over both, so
their ratio is fairer than two back-to-back loops; medians resist outliers.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()), "samples": int(len(ms))}


def measure(runners: dict[str, Callable], batches: list[dict], batch_size: int, warmup: int, repeats: int,
            budget_s: float = 20.0, min_repeats: int = 5) -> dict[str, dict]:
    """Time every runner on the same batches. The repeat count shrinks to fit `budget_s` per runner
    (estimated from the warm-up), never below `min_repeats`."""
    slowest = 0.0
    for run in runners.values():
        for i in range(max(warmup, 1)):
            start = time.perf_counter()
            run(batches[i % len(batches)])
            slowest = max(slowest, time.perf_counter() - start)
    rounds = max(min_repeats, min(repeats, int(budget_s / max(slowest, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(rounds):
        batch = batches[i % len(batches)]
        for name, run in runners.items():
            start = time.perf_counter()
            run(batch)
            times[name].append(time.perf_counter() - start)
    stats = {}
    for name, seconds in times.items():
        s = percentiles(seconds)
        s["throughput_per_s"] = batch_size / (s["p50_ms"] / 1e3)
        stats[name] = s
    return stats
