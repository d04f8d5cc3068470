"""The gate: a pure function of (baseline metrics, candidate metrics, thresholds) -> verdict.

Every threshold that is set becomes a check with its value, threshold and pass/fail. A check
whose metric was not measured fails: a verdict never passes on a number nobody measured. A latency
check fails too when other processes took more than BUSY_SHARE of the CPUs while it was timed:
contention slows the baseline and the candidate unequally, so the ratio says nothing.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from optimize.evaluate.benchmark import BUSY_SHARE


@dataclass(frozen=True)
class CheckSpec:
    threshold_key: str
    metric: str  # what the value is, for the report
    read: Callable[[dict, dict, dict], Optional[float]]  # (baseline, candidate, thresholds) -> value
    passes: Callable[[float, float], bool]
    comparison: str
    timed: bool = False  # a latency figure: not trusted when the machine was busy while timing


def _dig(metrics: Any, *keys) -> Any:
    for key in keys:
        if not isinstance(metrics, dict) or key not in metrics:
            return None
        metrics = metrics[key]
    return metrics


def _batch(thresholds: dict, key: str) -> str:
    return str(thresholds.get(key) or 1)


CHECKS = (
    CheckSpec(
        "min_cosine", "fidelity cosine (min)", lambda b, c, t: _dig(c, "fidelity", "cosine_min"), operator.ge, ">="
    ),
    CheckSpec(
        "min_mean_cosine",
        "fidelity cosine (mean)",
        lambda b, c, t: _dig(c, "fidelity", "cosine_mean"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "min_topk_agreement",
        "retrieval top-k agreement",
        lambda b, c, t: _dig(c, "fidelity", "topk_agreement"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "max_abs_error", "max abs error", lambda b, c, t: _dig(c, "fidelity", "max_abs_error"), operator.le, "<="
    ),
    CheckSpec(
        "min_speedup",
        "speedup at p50",
        lambda b, c, t: _dig(c, "speedup", _batch(t, "speedup_batch_size")),
        operator.ge,
        ">=",
        True,
    ),
    CheckSpec(
        "max_p95_ms",
        "latency p95 (ms)",
        lambda b, c, t: _dig(c, "latency", _batch(t, "latency_batch_size"), "p95_ms"),
        operator.le,
        "<=",
        True,
    ),
    CheckSpec("max_size_mb", "size on disk (MB)", lambda b, c, t: _dig(c, "size_mb"), operator.le, "<="),
    CheckSpec("max_peak_memory_mb", "peak memory (MB)", lambda b, c, t: _dig(c, "peak_memory_mb"), operator.le, "<="),
    CheckSpec(
        "max_accuracy_drop",
        "top-1 accuracy drop (points)",
        lambda b, c, t: _dig(c, "accuracy_drop_points"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "min_mask_iou",
        "mask IoU vs baseline (pooled over the set)",
        lambda b, c, t: _dig(c, "fidelity", "mask", "iou"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "min_mask_agreement",
        "mask pixel agreement",
        lambda b, c, t: _dig(c, "fidelity", "mask", "pixel_agreement"),
        operator.ge,
        ">=",
    ),
    CheckSpec("min_accuracy", "top-1 accuracy", lambda b, c, t: _dig(c, "top1_accuracy"), operator.ge, ">="),
    CheckSpec(
        "max_ppl_increase_pct",
        "held-out perplexity increase (%)",
        lambda b, c, t: _dig(c, "perplexity_increase_pct"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "min_decode_speedup",
        "decode tok/s p50 vs PyTorch FP32 greedy",
        lambda b, c, t: _dig(c, "decode_speedup"),
        operator.ge,
        ">=",
        True,
    ),
    CheckSpec(
        "max_lm_eval_drop",
        "lm-eval accuracy drop (points, worst task)",
        lambda b, c, t: _dig(c, "lm_eval_drop_pts"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "min_distill_recovery",
        "share of the pruning perplexity loss recovered by distillation",
        lambda b, c, t: _dig(c, "distill_recovery"),
        operator.ge,
        ">=",
    ),
)


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    value: Optional[float]
    comparison: str
    threshold: float
    passed: bool
    note: str = ""


@dataclass(frozen=True)
class Verdict:
    passed: bool
    checks: tuple[Check, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": [asdict(c) for c in self.checks]}


def judge(baseline: dict, candidate: dict, thresholds: dict) -> Verdict:
    checks = []
    busy = _dig(candidate, "timing", "other_cpu_share") or 0.0  # while the latency figures were timed
    for spec in CHECKS:
        threshold = thresholds.get(spec.threshold_key)
        if threshold is None:
            continue
        metric = spec.metric
        if spec.threshold_key == "min_speedup":
            metric += f", batch {_batch(thresholds, 'speedup_batch_size')}"
        if spec.threshold_key == "max_p95_ms":
            metric += f", batch {_batch(thresholds, 'latency_batch_size')}"
        value = spec.read(baseline, candidate, thresholds)
        if value is None:
            checks.append(Check(spec.threshold_key, metric, None, spec.comparison, threshold, False, "not measured"))
        else:
            untrusted = spec.timed and busy > BUSY_SHARE
            note = f"untrusted: other processes used {busy:.0%} of the CPUs while timing" if untrusted else ""
            passed = not untrusted and bool(spec.passes(value, threshold))
            checks.append(Check(spec.threshold_key, metric, float(value), spec.comparison, threshold, passed, note))
    return Verdict(all(c.passed for c in checks), tuple(checks))


def gate_keys() -> set[str]:
    return {spec.threshold_key for spec in CHECKS}


def untimed_keys() -> set[str]:
    """Thresholds on what does not depend on timing: accuracy, size and memory."""
    return {spec.threshold_key for spec in CHECKS if not spec.timed}
