"""One candidate in the race as the manifest and the report show it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from optimize.compile.race import cells
from optimize.compile.race.candidates import Candidate


@dataclass
class Entry:
    """One candidate in the race: how it was built, how it scored, whether it won and why not."""

    name: str
    spec: Candidate
    model: Any = None
    records: dict = field(default_factory=dict)
    cached: bool = False
    cache_rebuilt: str = ""  # why a cached copy was there but not used (cache.load_cached)
    build_s: float = 0.0
    build_peak_gb: float = 0.0  # the most its build's process and what it started held (sampled)
    size_mb: Optional[float] = None
    fidelity: dict = field(default_factory=dict)
    latency: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)  # causal LMs: perplexity, lm-eval, generation speed
    scores: dict = field(default_factory=dict)  # a task's own gated figures (classifiers: labeled accuracy)
    accuracy_checks: list = field(default_factory=list)
    passed: Optional[bool] = None
    outcome: str = ""
    slower_than_baseline_at: list = field(default_factory=list)  # workload points (set by race.pick)
    cost: Optional[float] = None  # the weighted cost over the workload's points (several points only)
    budget_s: float = 0.0  # the seconds its build may take (EngineRaceConfig.budget_of)
    refused: bool = False  # its engine cannot take the model (refused at plan time)
    budget_cut: bool = False  # not built: a build budget ran out before it started or while it built
    over_budget: bool = False  # built, but took longer than budget_s
    served_cut: Optional[str] = None  # causal LMs: why successive halving cut it after the first served round

    def kernels(self) -> Optional[dict]:
        """INT8 and float weighted nodes: from the quantize record (ONNX Runtime) or the OpenVINO op counts."""
        return (self.records.get("quantize") or {}).get("kernels") or (self.records.get("engine") or {}).get("kernels")

    def report(self) -> dict:
        return {
            "name": self.name,
            "engine": self.spec.engine,
            "engine_params": self.spec.engine_params,
            "quantize": self.spec.quantize,
            "quantize_params": self.spec.quantize_params,
            "precision": self.model.precision if self.model else None,
            "cached": self.cached,
            "cache_rebuilt": self.cache_rebuilt,
            "build_s": round(self.build_s, 1),
            "build_peak_gb": round(self.build_peak_gb, 2),
            "budget_s": round(self.budget_s, 1),
            "over_budget": self.over_budget,
            "size_mb": self.size_mb,
            "fidelity": self.fidelity,
            "latency": self.latency,
            "accuracy_checks": self.accuracy_checks,
            "passed_accuracy": self.passed,
            "metrics": self.metrics,
            "scores": self.scores,
            "kernels": self.kernels(),
            "columns": self.columns(),
            "slower_than_baseline_at": self.slower_than_baseline_at,
            "cost": self.cost,
            "served_cut": self.served_cut,
            "search_stopped": self.search_stopped(),
            "outcome": self.outcome,
        }

    def search_stopped(self) -> Optional[str]:
        """How a time box stopped the build's accuracy search (openvino_mixed), None when it did not."""
        return ((self.records.get("engine") or {}).get("accuracy_control") or {}).get("stopped")

    def columns(self) -> dict:
        """What the report shows of this candidate (cells.columns)."""
        return cells.columns(self)
