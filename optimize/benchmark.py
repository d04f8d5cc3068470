"""Latency harness: warm-up, then runners timed in alternation on the same batches.

Alternating the runners block by block spreads slow phases of a shared machine over both, so
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
            budget_s: float = 20.0, min_repeats: int = 5, block: int = 8) -> dict[str, dict]:
    """Time every runner on the same batches. The repeat count shrinks to fit `budget_s` per runner
    (estimated from the warm-up), never below `min_repeats`.

    Runners take turns in blocks of `block` timed calls, each block opened by one untimed call and the
    order reversed every block. Timed call by call, a runner pays for the other's threads still
    spinning on the cores (ONNX Runtime's workers spin-wait after a run, OpenMP's too): on 2 cores that
    doubled PyTorch's latency next to ONNX Runtime and inflated speedups up to 2x."""
    slowest = 0.0
    for run in runners.values():
        for i in range(max(warmup, 1)):
            start = time.perf_counter()
            run(batches[i % len(batches)])
            slowest = max(slowest, time.perf_counter() - start)
    rounds = max(min_repeats, min(repeats, int(budget_s / max(slowest, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for first in range(0, rounds, block):
        for name in order:
            run = runners[name]
            run(batches[first % len(batches)])  # untimed: lets the previous runner's threads go idle
            for i in range(first, min(first + block, rounds)):
                batch = batches[i % len(batches)]
                start = time.perf_counter()
                run(batch)
                times[name].append(time.perf_counter() - start)
        order.reverse()
    stats = {}
    for name, seconds in times.items():
        s = percentiles(seconds)
        s["throughput_per_s"] = batch_size / (s["p50_ms"] / 1e3)
        stats[name] = s
    return stats
