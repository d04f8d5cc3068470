"""The gate: a pure function of (baseline metrics, candidate metrics, thresholds) -> verdict.

Every threshold that is set becomes a check with its value, threshold and pass/fail. A check
whose metric was not measured fails: a verdict never passes on a number nobody measured. A latency
check fails too when other processes took more than BUSY_SHARE of the CPUs while it was timed:
contention slows the baseline and the candidate unequally, so the ratio says nothing.

Speed checks are made at the points they are asked to: gate.min_speedup and gate.max_p95_ms at one
batch size or at `all` the workload's batch sizes, min_decode_speedup at one request shape or `all`,
the served checks at every concurrency level the load was driven at (gate.served_concurrency, else
workload.concurrency); each point of `all` is a check of its own (min_speedup[batch=32],
max_served_ttft_p95_ms[concurrency=16]), so CI shows which point failed (a workload of one point
keeps the plain name).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from optimize.evaluate.benchmark import BUSY_SHARE
from optimize.evaluate.labeled import interval_note
from optimize.plan import GateSettings
from optimize.workload import ALL, Workload


@dataclass(frozen=True)
class CheckSpec:
    threshold_key: str
    metric: str  # what the value is, for the report
    # (baseline, candidate, point) -> value; point: the batch size or request shape ("1024x128")
    # the check is made at, None for a check of the run as a whole
    read: Callable[[dict, dict, Optional[str]], Optional[float]]
    passes: Callable[[float, float], bool]
    comparison: str
    timed: bool = False  # a latency figure: not trusted when the machine was busy while timing
    # The threshold naming the point(s) checked: a batch size or `all` (per="batch"), a request
    # shape, `all` or null (per="request"); a check of `all` is made once per workload point.
    selector: Optional[str] = None
    per: str = ""
    note: Optional[Callable[[dict], str]] = None  # candidate -> what the report adds (an interval)
    # Where the share of the CPUs other processes used while this figure was timed is kept (the
    # served load's own); empty: the evaluation's timing.
    busy_path: tuple[str, ...] = ()
    # The threshold the check takes when its own key is null, from the other thresholds (None: not
    # checked): a setting that asks for a measurement implies the check that judges it.
    implied: Optional[Callable[[GateSettings], Optional[float]]] = None
    served: bool = False  # measured on the served artifact (optimize/tasks/lm_served.py), after any race
    # (candidate, threshold) -> why the measurement cannot decide the check ("" when it can): a drop
    # whose interval is wider than the threshold fails instead of passing by noise.
    unresolved: Optional[Callable[[dict, float], str]] = None
    # Measured by the final evaluation only (the standard tasks: minutes a candidate), so the race does
    # not judge its candidates on it.
    evaluation_only: bool = False


def _dig(metrics: Any, *keys) -> Any:
    for key in keys:
        if not isinstance(metrics, dict) or key not in metrics:
            return None
        metrics = metrics[key]
    return metrics


def _served(candidate: dict, key: str, level: Optional[str] = None) -> Any:
    """A figure of the served load (optimize/tasks/lm_served.py), at `level` clients where the load was
    driven at several; not measured when any of its requests failed, so the check fails instead of
    judging only the requests that succeeded."""
    served = _dig(candidate, "served")
    if level is not None and isinstance(served, dict) and "levels" in served:
        served = _dig(served, "levels", level)
    if not isinstance(served, dict) or served.get("failed"):
        return None
    return served.get(key)


def _invalid_structured(candidate: dict, level: Optional[str] = None) -> Any:
    """Constrained replies of the served load that did not parse or match their schema; not measured
    when no constrained reply could be judged (every one cut by max_tokens, or none sent)."""
    structured = _served(candidate, "structured", level)
    if not isinstance(structured, dict) or not (structured.get("valid", 0) + structured.get("invalid", 0)):
        return None
    return structured["invalid"]


def _structured_note(candidate: dict) -> str:
    structured = _dig(candidate, "served", "structured") or {}
    if not structured:
        return ""
    valid, cut, sent = structured.get("valid"), structured.get("cut"), structured.get("requests")
    return f"{valid} valid, {cut} cut by max_tokens, of {sent} constrained requests"


def _structured_share(gate: GateSettings) -> Optional[float]:
    return 0 if gate.served_structured_share > 0 else None


def _decode_speedup(candidate: dict, shape: Optional[str]) -> Any:
    """The workload's first request's decode speedup, or the named shape's."""
    if shape is None:
        return _dig(candidate, "decode_speedup")
    return _dig(candidate, "requests", shape, "decode_speedup")


def _task_drop(candidate: dict) -> Any:
    """The standard tasks' paired drop in points, pooled over every task's items."""
    return _dig(candidate, "standard_tasks", "pooled", "drop_pts")


def _task_drop_unresolved(candidate: dict, threshold: float) -> str:
    """A drop measured on too few items to tell a drop of `threshold` points from noise: the paired
    interval's half-width is wider than the threshold."""
    pooled = _dig(candidate, "standard_tasks", "pooled") or {}
    half = pooled.get("half_width_pts")
    if half is None or half <= threshold:
        return ""
    return (
        f"cannot resolve a {threshold:g}-point drop with {pooled.get('items')} items (the paired 95% interval is "
        f"+/-{half:.1f} points): raise evaluate.task_params.standard_limit"
    )


def _task_note(candidate: dict) -> str:
    tasks = _dig(candidate, "standard_tasks", "tasks") or {}
    parts = []
    for name, t in tasks.items():
        low, high = t["interval"]["low"], t["interval"]["high"]
        parts.append(f"{name} {t['drop_pts']:+.1f} [{low:+.1f}, {high:+.1f}] (-{t['lost']}/+{t['gained']})")
    return "; ".join(parts)


CHECKS = (
    CheckSpec(
        "min_cosine", "fidelity cosine (min)", lambda b, c, point: _dig(c, "fidelity", "cosine_min"), operator.ge, ">="
    ),
    CheckSpec(
        "min_mean_cosine",
        "fidelity cosine (mean)",
        lambda b, c, point: _dig(c, "fidelity", "cosine_mean"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "min_topk_agreement",
        "retrieval top-k agreement",
        lambda b, c, point: _dig(c, "fidelity", "topk_agreement"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "max_abs_error", "max abs error", lambda b, c, point: _dig(c, "fidelity", "max_abs_error"), operator.le, "<="
    ),
    CheckSpec(
        "min_speedup",
        "speedup at p50",
        lambda b, c, point: _dig(c, "speedup", point),
        operator.ge,
        ">=",
        True,
        "speedup_batch_size",
        "batch",
    ),
    CheckSpec(
        "max_p95_ms",
        "latency p95 (ms)",
        lambda b, c, point: _dig(c, "latency", point, "p95_ms"),
        operator.le,
        "<=",
        True,
        "latency_batch_size",
        "batch",
    ),
    CheckSpec("max_size_mb", "size on disk (MB)", lambda b, c, point: _dig(c, "size_mb"), operator.le, "<="),
    CheckSpec(
        "max_peak_memory_mb", "peak memory (MB)", lambda b, c, point: _dig(c, "peak_memory_mb"), operator.le, "<="
    ),
    CheckSpec(
        "max_accuracy_drop",
        "top-1 accuracy drop (points)",
        lambda b, c, point: _dig(c, "accuracy_drop_points"),
        operator.le,
        "<=",
        note=lambda c: interval_note(c, "accuracy_drop_points"),
    ),
    CheckSpec(
        "max_f1_drop",
        "F1 drop (points; macro-F1, or entity F1 for NER)",
        lambda b, c, point: _dig(c, "f1_drop_points"),
        operator.le,
        "<=",
        note=lambda c: interval_note(c, "f1_drop_points"),
    ),
    CheckSpec(
        "min_prediction_agreement",
        "predictions equal to the baseline's (share)",
        lambda b, c, point: _dig(c, "prediction_agreement"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "min_mask_iou",
        "mask IoU vs baseline (pooled over the set)",
        lambda b, c, point: _dig(c, "fidelity", "mask", "iou"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "min_mask_agreement",
        "mask pixel agreement",
        lambda b, c, point: _dig(c, "fidelity", "mask", "pixel_agreement"),
        operator.ge,
        ">=",
    ),
    CheckSpec("min_accuracy", "top-1 accuracy", lambda b, c, point: _dig(c, "top1_accuracy"), operator.ge, ">="),
    CheckSpec(
        "max_ppl_increase_pct",
        "held-out perplexity increase (%)",
        lambda b, c, point: _dig(c, "perplexity_increase_pct"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "max_ppl_increase_over_source_pct",
        "held-out perplexity increase over the source's own run (%)",
        lambda b, c, point: _dig(c, "perplexity_increase_pct"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "min_decode_speedup",
        "decode tok/s p50 vs PyTorch FP32 greedy",
        lambda b, c, point: _decode_speedup(c, point),
        operator.ge,
        ">=",
        True,
        "request_shape",
        "request",
    ),
    CheckSpec(
        "max_served_ttft_p95_ms",
        "served time to first token p95 (ms)",
        lambda b, c, point: _served(c, "ttft_p95_ms", point),
        operator.le,
        "<=",
        True,
        "served_concurrency",
        "concurrency",
        busy_path=("served", "other_cpu_share"),
        served=True,
    ),
    CheckSpec(
        "min_served_tokens_per_s",
        "served output tok/s, all clients",
        lambda b, c, point: _served(c, "tokens_per_s", point),
        operator.ge,
        ">=",
        True,
        "served_concurrency",
        "concurrency",
        busy_path=("served", "other_cpu_share"),
        served=True,
    ),
    CheckSpec(
        "max_served_invalid_structured",
        "served constrained replies not matching their JSON schema",
        lambda b, c, point: _invalid_structured(c, point),
        operator.le,
        "<=",
        selector="served_concurrency",
        per="concurrency",
        note=_structured_note,
        implied=_structured_share,
        served=True,
    ),
    CheckSpec(
        "max_lm_eval_drop",
        "lm-eval accuracy drop (points, worst task)",
        lambda b, c, point: _dig(c, "lm_eval_drop_pts"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "max_mean_kld",
        "mean KL divergence from the baseline per token (nats)",
        lambda b, c, point: _dig(c, "fidelity", "mean_kld"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "max_p99_kld",
        "99th-percentile KL divergence per token (nats)",
        lambda b, c, point: _dig(c, "fidelity", "p99_kld"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "min_top1_agreement",
        "next-token argmax equal to the baseline's (share)",
        lambda b, c, point: _dig(c, "fidelity", "top1_agreement"),
        operator.ge,
        ">=",
    ),
    CheckSpec(
        "max_rms_delta_p_pct",
        "RMS change of the correct token's probability (points)",
        lambda b, c, point: _dig(c, "fidelity", "rms_delta_p_pct"),
        operator.le,
        "<=",
    ),
    CheckSpec(
        "max_task_drop_pts",
        "standard tasks' accuracy drop (points, pooled, paired)",
        lambda b, c, point: _task_drop(c),
        operator.le,
        "<=",
        note=_task_note,
        unresolved=_task_drop_unresolved,
        evaluation_only=True,
    ),
    CheckSpec(
        "min_distill_recovery",
        "share of the pruning perplexity loss recovered by distillation",
        lambda b, c, point: _dig(c, "distill_recovery"),
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


def judge(
    baseline: dict, candidate: dict, thresholds: GateSettings | Mapping[str, Any], workload: Optional[Workload] = None
) -> Verdict:
    """Every threshold set becomes a check; a threshold on `all` points becomes one check per point of
    `workload` (without one: per point measured), named like min_speedup[batch=32]."""
    gate = GateSettings.of(thresholds)
    checks = []
    busy = _dig(candidate, "timing", "other_cpu_share") or 0.0  # while the latency figures were timed
    for spec in CHECKS:
        threshold = gate[spec.threshold_key]
        if threshold is None and spec.implied is not None:
            threshold = spec.implied(gate)
        if threshold is None:
            continue
        for name, metric, point in _points(spec, gate, candidate, workload):
            value = spec.read(baseline, candidate, point)
            if value is None:
                checks.append(Check(name, metric, None, spec.comparison, threshold, False, "not measured"))
                continue
            share = _dig(candidate, "timing", "points", point) if point is not None else None
            share = _dig(candidate, *spec.busy_path) if spec.busy_path else share
            if spec.per == "concurrency" and point is not None and _dig(candidate, "served", "levels", point):
                share = _dig(candidate, "served", "levels", point, "other_cpu_share")
            share = busy if share is None else share
            untrusted = spec.timed and share > BUSY_SHARE
            note = f"untrusted: other processes used {share:.0%} of the CPUs while timing" if untrusted else ""
            note = note or (spec.note(candidate) if spec.note else "")
            unresolved = spec.unresolved(candidate, threshold) if spec.unresolved else ""
            if unresolved:
                note = f"{unresolved}; {note}" if note else unresolved
            passed = not untrusted and not unresolved and bool(spec.passes(value, threshold))
            checks.append(Check(name, metric, float(value), spec.comparison, threshold, passed, note))
    return Verdict(all(c.passed for c in checks), tuple(checks))


def _is_all(selector: Any) -> bool:
    return isinstance(selector, str) and selector.strip().lower() == ALL


def _points(spec: CheckSpec, gate: GateSettings, candidate: dict, workload: Optional[Workload]) -> list:
    """(check name, metric, point) for each point the check is made at."""
    name, metric = spec.threshold_key, spec.metric
    if spec.per == "batch":
        selector = gate.get(spec.selector or "")
        if not _is_all(selector):
            batch = str(selector or 1)
            return [(name, f"{metric}, batch {batch}", batch)]
        if workload is not None:
            keys = [p.key for p in workload.batches]
        else:
            keys = sorted(_dig(candidate, "latency") or {}, key=int)
        return _each(name, metric, "batch", keys)
    if spec.per == "request":
        selector = gate.get(spec.selector or "")
        if selector is None:
            return [(name, metric, None)]
        if not _is_all(selector):
            return [(name, f"{metric}, shape {selector}", str(selector).strip().lower())]
        keys = [p.key for p in workload.requests] if workload is not None else list(_dig(candidate, "requests") or {})
        return _each(name, metric, "shape", keys)
    if spec.per == "concurrency":
        return _each(name, metric, "concurrency", _levels(gate, candidate, workload))
    return [(name, metric, None)]


def _levels(gate: GateSettings, candidate: dict, workload: Optional[Workload]) -> list[str]:
    """The client counts the served load was driven at (gate.served_concurrency, else every level of
    workload.concurrency): what was measured, else what was asked for (its checks then fail unmeasured)."""
    measured = _dig(candidate, "served", "levels")
    if isinstance(measured, dict) and measured:
        return list(measured)
    asked = gate.served_concurrency
    if asked is not None and not _is_all(asked):
        return [str(asked)]
    if workload is not None:
        return [level.key for level in workload.concurrency]
    clients = _dig(candidate, "served", "clients")
    return [str(clients)] if clients is not None else []


def _each(name: str, metric: str, kind: str, keys: list[str]) -> list:
    """One check per point, named for it (min_speedup[batch=32]); a workload of one point keeps the
    check's plain name, as before workloads, so a one-point recipe's checks read exactly as they did."""
    if len(keys) == 1:
        return [(name, f"{metric}, {kind} {keys[0]}", keys[0])]
    return [(f"{name}[{kind}={k}]", f"{metric}, {kind} {k}", k) for k in keys] or [(name, metric, None)]


def gate_keys() -> set[str]:
    return {spec.threshold_key for spec in CHECKS}


def untimed_keys() -> set[str]:
    """Thresholds on what does not depend on timing, measured before serving: accuracy, size, memory."""
    return {spec.threshold_key for spec in CHECKS if not spec.timed and not spec.served and not spec.evaluation_only}


def served_keys() -> set[str]:
    """Thresholds on what the served load measures (optimize/tasks/lm_served.py)."""
    return {spec.threshold_key for spec in CHECKS if spec.served}
