"""Engine: the race. Build the candidates that make sense for the model and this machine, measure each
with the same harness, and ship the fastest that passes every accuracy check of the gate.

Which runtime and precision wins depends on the CPU: ONNX Runtime's INT8 GEMM runs at its FP32
speed on AVX2 without VNNI, OpenVINO's bf16 needs AVX512-BF16 or AMX, and oneDNN's kernels behind
OpenVINO pull ahead where AMX exists. So nothing here is chosen in advance: every candidate is
built, scored against the baseline on the evaluation data (the data the gate judges), timed in one
block-alternating benchmark with the baseline, and recorded in the manifest, winners and losers
alike, with the reason each lost. Built candidates are cached by content hash (the model's weights,
the candidate's methods and parameters, the calibration set, the package versions and the CPU), so a
rerun with another gate rebuilds nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from engines.onnx_export import copy_onnx
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    engine: str
    engine_params: dict = field(default_factory=dict)
    quantize: Optional[str] = None
    quantize_params: dict = field(default_factory=dict)


# The candidates the race knows, by name. ORT INT8 comes as the sensitivity-fallback variant (a few
# MatMuls kept FP32 until the calibration cosine holds) and as all-INT8; static QDQ with the settings
# that held min cosine 0.99 on MiniLM (percentile calibration, GELU-fed MatMuls kept FP32).
CANDIDATES: dict[str, Candidate] = {
    "ort_fp32": Candidate("onnx"),
    "ort_int8_dynamic": Candidate("onnx", quantize="ort_int8_dynamic"),
    "ort_int8_dynamic_all": Candidate(
        "onnx", quantize="ort_int8_dynamic", quantize_params={"fallback_min_cosine": None}
    ),
    "ort_int8_qattention": Candidate("onnx", quantize="ort_int8_dynamic", quantize_params={"quantize_attention": True}),
    "ort_int8_static": Candidate(
        "onnx",
        quantize="ort_int8_static_qdq",
        quantize_params={
            "op_types": ["MatMul"],
            "calibrate_method": "percentile",
            "percentile": 99.999,
            "exclude_consumers_of": ["BiasGelu", "Gelu", "FastGelu"],
            "fallback_min_cosine": 0.995,
            "max_fp32_nodes": 6,
        },
    ),
    "openvino_f32": Candidate("openvino", {"precision": "f32"}),
    "openvino_bf16": Candidate("openvino", {"precision": "bf16"}),
    "openvino_int8": Candidate("openvino", {"precision": "int8"}),
    # NNCF's accuracy control reverts the INT8 layers that cost the gate's cosine to float (bf16 where
    # the CPU has it), so an INT8 that fails the gate all-INT8 can still ship mostly INT8.
    "openvino_mixed": Candidate("openvino_mixed"),
}
# Causal LMs: decoders with KV cache from ONNX Runtime GenAI and OpenVINO GenAI, weight-only INT4
# (with 8-bit LM head and sensitive layers where the builder offers it) and INT8.
CANDIDATES.update(
    {
        "ort_genai_int4": Candidate("onnxruntime_genai", {"precision": "int4", "accuracy_level": 4}),
        "ort_genai_int4_k_quant_mixed": Candidate(
            "onnxruntime_genai", {"precision": "int4", "accuracy_level": 4, "algo_config": "k_quant_mixed"}
        ),
        "openvino_genai_int4": Candidate("openvino_genai", {"weight_format": "int4_asym", "group_size": 64}),
        "openvino_genai_int4_g32": Candidate("openvino_genai", {"weight_format": "int4_asym", "group_size": 32}),
        # Data-aware INT4 (AWQ + scale estimation on the calibration text): SmolLM2 +15.5% perplexity at
        # group 64 against +32% for plain rounding.
        "openvino_genai_int4_awq": Candidate(
            "openvino_genai", {"weight_format": "int4_asym", "group_size": 64, "awq": True, "scale_estimation": True}
        ),
        "openvino_genai_int4_g32_awq": Candidate(
            "openvino_genai", {"weight_format": "int4_asym", "group_size": 32, "awq": True, "scale_estimation": True}
        ),
        "openvino_genai_int8": Candidate("openvino_genai", {"weight_format": "int8_asym"}),
    }
)
DEFAULT_CANDIDATES = {
    "causal_lm": [
        "ort_genai_int4_k_quant_mixed",
        "openvino_genai_int4_awq",
        "openvino_genai_int4_g32_awq",
        "openvino_genai_int8",
    ],
    "default": [
        "ort_fp32",
        "ort_int8_dynamic",
        "ort_int8_qattention",
        "ort_int8_dynamic_all",
        "openvino_f32",
        "openvino_bf16",
        "openvino_int8",
        "openvino_mixed",
    ],
}


# A candidate's build budget when the recipe sets none: this many seconds per 100M parameters (embedding
# included: a large vocabulary lengthens every export and every calibration pass), at least the minimum.
# The one race-wide 300 s this replaces built SmolLM2-135M's four LM candidates, and one of a 262k-token
# vocabulary model's (about 270M parameters), whose builds each took several times longer.
BUDGET_S_PER_100M_PARAMS = 120.0
MIN_CANDIDATE_BUDGET_S = 150.0


def scaled_budget_s(model) -> float:
    """The default build budget of one candidate for this model (an ONNX graph counts its weights)."""
    return max(MIN_CANDIDATE_BUDGET_S, BUDGET_S_PER_100M_PARAMS * parameter_count(model) / 1e8)


def parameter_count(model) -> int:
    if getattr(model, "module", None) is not None and hasattr(model.module, "parameters"):
        return sum(p.numel() for p in model.module.parameters())
    if getattr(model, "onnx_path", None) is not None:
        import numpy as np
        import onnx

        graph = onnx.load(str(model.onnx_path), load_external_data=False).graph
        return sum(int(np.prod(i.dims)) for i in graph.initializer)
    return 0


def default_candidates(task: str) -> list[str]:
    return list(DEFAULT_CANDIDATES.get(task, DEFAULT_CANDIDATES["default"]))


@dataclass
class EngineRaceConfig:
    """Example recipe (add static INT8 to the default set, five minutes at most):

    engine:
      method: auto
      params: {candidates: [ort_fp32, ort_int8_dynamic, ort_int8_static, openvino_bf16, openvino_int8],
               time_budget_s: 300}
    """

    candidates: List[str] = field(default_factory=list)  # empty: the model task's default set
    # Parameters merged into a candidate's methods, by candidate name:
    # {openvino_int8: {engine: {smooth_quant_alpha: 0.5}}, ort_int8_dynamic: {quantize: {max_fp32_nodes: 4}}}
    candidate_params: Dict[str, Any] = field(default_factory=dict)
    # Building stops when the race's budget is spent; candidates not built are recorded and the report
    # says so before the winner. null: the sum of the candidates' budgets (candidate_budget_s).
    time_budget_s: Optional[float] = None
    # Seconds each candidate's build may take, by name ("default" for the rest). null: scaled by the
    # model (BUDGET_S_PER_100M_PARAMS, at least MIN_CANDIDATE_BUDGET_S): a 262k-token vocabulary
    # makes every build of a small model several times longer.
    candidate_budget_s: Dict[str, float] = field(default_factory=dict)
    timing_repeats: int = 16  # timed calls per candidate and batch size (fewer when slow)
    cache: bool = True  # reuse candidates built before with the same content hash

    def validate(self):
        unknown = [c for c in self.candidates if c not in CANDIDATES]
        if unknown:
            raise RecipeError(
                f"engine.params.candidates={self.candidates}: unknown {unknown} (known: {', '.join(CANDIDATES)})"
            )
        stray = set(self.candidate_params) - set(self.candidates or CANDIDATES)
        if stray:
            raise RecipeError(f"engine.params.candidate_params names {sorted(stray)}, which are not candidates")
        for name, params in self.candidate_params.items():
            if not isinstance(params, dict) or set(params) - {"engine", "quantize"}:
                raise RecipeError(f"engine.params.candidate_params.{name} takes engine: and quantize: sections")
        if (self.time_budget_s is not None and self.time_budget_s <= 0) or self.timing_repeats < 1:
            raise RecipeError("engine.params.time_budget_s and timing_repeats must be positive")
        stray = set(self.candidate_budget_s) - set(self.candidates or CANDIDATES) - {"default"}
        if stray:
            raise RecipeError(f"engine.params.candidate_budget_s names {sorted(stray)}, which are not candidates")
        if any(not isinstance(v, (int, float)) or v <= 0 for v in self.candidate_budget_s.values()):
            raise RecipeError("engine.params.candidate_budget_s: every budget must be a positive number of seconds")

    def budget_of(self, name: str, model) -> float:
        """Seconds candidate `name` may take: the recipe's, else scaled by the model's size."""
        given = self.candidate_budget_s.get(name, self.candidate_budget_s.get("default"))
        return float(given) if given is not None else scaled_budget_s(model)

    def spec(self, name: str) -> Candidate:
        base, extra = CANDIDATES[name], self.candidate_params.get(name) or {}
        return Candidate(
            base.engine,
            {**base.engine_params, **(extra.get("engine") or {})},
            base.quantize,
            {**base.quantize_params, **(extra.get("quantize") or {})},
        )


@dataclass
class Entry:
    """One candidate in the race: how it was built, how it scored, whether it won and why not."""

    name: str
    spec: Candidate
    model: Any = None
    records: dict = field(default_factory=dict)
    cached: bool = False
    build_s: float = 0.0
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
    budget_cut: bool = False  # not built: the race's build budget was spent before it started
    over_budget: bool = False  # built, but took longer than budget_s

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
            "build_s": round(self.build_s, 1),
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
            "outcome": self.outcome,
        }

    def columns(self) -> dict:
        """What the report shows of this candidate: its build time, then the task's own figures."""
        return {"build s": self.build_words(), **self.figures()}

    def build_words(self) -> str:
        if self.model is None:
            return "-"
        if self.cached:
            return "cached"
        return f"{self.build_s:.0f}" + (f" (over {self.budget_s:.0f})" if self.over_budget else "")

    def figures(self) -> dict:
        if self.metrics:
            from optimize.compile import race_lm

            return race_lm.columns(self)
        cells = {
            "cosine min": _fmt(self.fidelity.get("cosine_min")),
            "cosine mean": _fmt(self.fidelity.get("cosine_mean")),
        }
        for batch, timing in self.latency.items():
            cells[f"p50 ms b{batch} (x base)"] = f"{timing['p50_ms']:.2f} ({timing['x_baseline']:.2f}x)"
        if self.cost is not None:
            cells["workload ms (weighted p50)"] = f"{self.cost:.2f}"
        return cells


def _fmt(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@register(
    "engine",
    "auto",
    EngineRaceConfig,
    needs_calibration=True,
    input_format="torch",
    builds_candidates=True,
    tasks=("sentence_embedding", "generic", "causal_lm", "text_classification", "token_classification"),
)
def engine_race(model, cfg: EngineRaceConfig, ctx):
    """Race ONNX Runtime and OpenVINO candidates on this machine; ship the fastest over the recipe's
    workload that passes accuracy."""
    from optimize import workload as workloads

    started = time.monotonic()
    workload = workloads.resolve(ctx.cfg)
    lm = model.task == "causal_lm"
    exported = model if lm else _export_once(model, ctx)  # decoders are built from the module itself
    entries = [Entry(name, cfg.spec(name)) for name in cfg.candidates or default_candidates(model.task)]
    if lm:
        _refuse_at_plan_time(entries, model)
    key_base = _identity(model, ctx)
    budget = _Budget(cfg, entries, model)  # its clock starts here, at the first build
    with _progress(len(entries)) as bar:
        for entry in entries:
            bar.set_description(f"race: building {entry.name}")
            if entry.refused:
                pass
            elif budget.spent():
                entry.outcome = f"not built: {budget.describe()} was spent before it started"
                entry.budget_cut = True
            else:
                _build(entry, exported, ctx, key_base if cfg.cache else None)
                budget.note(entry)
            bar.update(1)
    built = [e for e in entries if e.model is not None]
    _say_if_fewer(entries, built)
    if not built:
        raise RecipeError(
            "engine.method=auto: no candidate could be built here: "
            + "; ".join(f"{e.name}: {e.outcome}" for e in entries)
        )
    if lm:
        from optimize.compile import race_lm

        baseline = race_lm.score(built, ctx, workload)
        winner = race_lm.choose(built, ctx, workload, baseline)
    else:
        baseline = _score(built, ctx, workload)
        winner = _choose(built, ctx, workload, baseline)
    export = ctx.stage_records.pop("export", None)
    ctx.stage_records.update(winner.records)  # the winner's own engine (and quantize) records
    winner_engine = ctx.stage_records.pop("engine", None)
    record = _race_record(ctx, workload, entries, winner, baseline, export, winner_engine, time.monotonic() - started)
    record.update(budget=budget.record(entries), fewer_than_asked=fewer_than_asked(entries))
    ctx.record("engine", record)
    return winner.model


# ---------------------------------------------------------------- planning and the budget


def _refuse_at_plan_time(entries: list[Entry], model) -> None:
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


class _Budget:
    """The race's build budget: the recipe's time_budget_s, or the sum of the candidates' own budgets
    (candidate_budget_s, else scaled by the model's size). Counted from the first build; a candidate
    starts only while some is left (a build in progress is not stopped: the runtimes build in this
    process), and one that took longer than its own budget is said in its record."""

    def __init__(self, cfg: EngineRaceConfig, entries: list[Entry], model):
        for entry in entries:
            entry.budget_s = cfg.budget_of(entry.name, model)
        self.per_candidate = cfg.time_budget_s is None
        planned = [e for e in entries if not e.refused]
        self.total_s = cfg.time_budget_s if cfg.time_budget_s is not None else sum(e.budget_s for e in planned)
        self.started = time.monotonic()

    def spent(self) -> bool:
        return time.monotonic() - self.started > self.total_s

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


def fewer_than_asked(entries: list[Entry]) -> Optional[str]:
    """One line when the winner is chosen from fewer candidates than the recipe asked for, naming why."""
    built = [e for e in entries if e.model is not None]
    if len(built) == len(entries):
        return None
    missing = [e for e in entries if e.model is None]
    reasons = {
        "cut by the build budget": [e.name for e in missing if e.budget_cut],
        "refused at plan time": [e.name for e in missing if e.refused],
        "failed to build": [e.name for e in missing if not e.budget_cut and not e.refused],
    }
    said = "; ".join(f"{why}: {', '.join(names)}" for why, names in reasons.items() if names)
    return f"the winner is chosen from {len(built)} of the {len(entries)} candidates asked for ({said})"


def _say_if_fewer(entries: list[Entry], built: list[Entry]) -> None:
    line = fewer_than_asked(entries)
    if line and built:
        log.warning("race: %s", line)


# ---------------------------------------------------------------- building


def _export_once(model, ctx):
    """One checked ONNX export (fused for ONNX Runtime) that every candidate starts from."""
    from optimize.compile.onnx import OnnxExportConfig, onnx_engine

    if model.kind == "onnx":
        return model
    exported = onnx_engine(model, OnnxExportConfig(), ctx)
    ctx.stage_records["export"] = ctx.stage_records.pop("engine", {})
    folder = ctx.scratch / "race" / "export"
    folder.mkdir(parents=True, exist_ok=True)
    return exported.with_onnx(copy_onnx(exported.onnx_path, folder))


def _build(entry: Entry, exported, ctx, key_base: Optional[str]) -> None:
    """Build one candidate from the export (or take it from the cache); a candidate that cannot be
    built here (no OpenVINO, no bf16, a method that does not apply) is recorded, not fatal."""
    from optimize import registry

    folder = _cache_dir(key_base, entry.spec) if key_base else ctx.scratch / "race" / entry.name
    if folder and (folder / "candidate.json").is_file():
        entry.model, entry.records = _load_cached(folder, exported)
        entry.cached = True
        return
    start = time.monotonic()
    before = dict(ctx.stage_records)
    try:
        methods = [("engine", entry.spec.engine, entry.spec.engine_params)]
        if entry.spec.quantize:
            methods.append(("quantize", entry.spec.quantize, entry.spec.quantize_params))
        built = exported
        for stage, name, params in methods:
            method = registry.get(stage, name)
            built = method.fn(built, registry.build_config(method, dict(params)), ctx)
    except RecipeError as exc:
        entry.outcome = f"not built: {exc}"
        log.info("race: %s not built: %s", entry.name, exc)
        return
    finally:
        records = {k: v for k, v in ctx.stage_records.items() if before.get(k) is not v}
        ctx.stage_records.clear()
        ctx.stage_records.update(before)
    entry.build_s = time.monotonic() - start
    entry.model, entry.records = _save(built, records, folder), records


def _save(model, records: dict, folder: Path):
    """Move a built candidate's engine files into `folder` (atomically when it is the cache)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if model.kind == "onnx":
        copy_onnx(model.onnx_path, tmp)
        saved: dict[str, Any] = {"kind": "onnx", "file": "model.onnx"}
    else:
        shutil.copytree(model.engine_dir, tmp, dirs_exist_ok=True)
        saved = {"kind": "engine"}
    saved.update(engine=model.engine, precision=model.precision, layer_precision=model.layer_precision, records=records)
    (tmp / "candidate.json").write_text(json.dumps(saved, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return _model_from(folder, saved, model)


def _load_cached(folder: Path, exported):
    saved = json.loads((folder / "candidate.json").read_text())
    return _model_from(folder, saved, exported), saved["records"]


def _model_from(folder: Path, saved: dict, template):
    import dataclasses

    if saved["kind"] == "onnx":
        model = template.with_onnx(folder / saved["file"], precision=saved["precision"])
        model.engine.update(saved["engine"], file=saved["file"])
    else:
        model = template.with_engine(folder, saved["engine"], precision=saved["precision"])
    return dataclasses.replace(model, layer_precision=saved.get("layer_precision") or {})


# ---------------------------------------------------------------- the cache


def _identity(model, ctx) -> str:
    """What every candidate is built from: the weights themselves (a pruned or distilled module's
    too), the calibration set, the package versions and the CPU features that change kernels."""
    from engines.hardware import CPU_FEATURES, cpu_flags
    from optimize.environment import package_versions

    identity = {
        "weights": _weights_hash(model),
        "task": model.task,
        "calibration": ctx.calibration().describe(),
        "max_length": ctx.cfg.model.max_length,
        "packages": package_versions(),
        "cpu": sorted(f for f in CPU_FEATURES if f in cpu_flags()),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _weights_hash(model) -> str:
    from engines.artifact import sha256_file

    if model.kind == "onnx":
        return sha256_file(model.onnx_path)
    digest = hashlib.sha256()
    for name, tensor in model.module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _cache_dir(key_base: str, spec: Candidate) -> Path:
    from optimize.models import cache_root

    key = hashlib.sha256((key_base + json.dumps(asdict(spec), sort_keys=True)).encode()).hexdigest()[:24]
    return cache_root() / "race" / key


# ---------------------------------------------------------------- scoring and choosing


def _score(entries: list[Entry], ctx, workload) -> dict:
    """Fidelity of every candidate against the baseline on the evaluation data, then one timing run
    per batch size (evaluate.batch_sizes and every workload point) with the baseline and every
    candidate taking turns, timed again while the machine was busy. Returns the baseline's p50s."""
    from engines import load_engine
    from optimize import tasks
    from optimize.evaluate import benchmark, harness

    task = tasks.get(entries[0].model.task)
    baseline = _baseline_runner(ctx, task)
    runners = {}
    for entry in entries:
        runner = load_engine(entry.model.engine_dir, entry.model.engine, threads=ctx.threads)
        runners[entry.name] = runner
        entry.size_mb = _size_mb(entry.model)
    inputs, _ = harness.evaluation_inputs(ctx, next(iter(runners.values())))
    batches = harness.batches_of(inputs, harness.FIDELITY_BATCH)
    reference = harness.run_all(baseline, batches)
    for entry in entries:
        outputs = harness.run_all(runners[entry.name], batches)
        entry.fidelity = harness.fidelity_of(reference, outputs, task.fidelity_output, ctx.cfg.evaluate.top_k)
        if hasattr(task, "race_scores"):  # classifiers: labeled accuracy, the figures their gate reads
            entry.scores = task.race_scores(reference, outputs, ctx)
    race_cfg = ctx.cfg.engine.params
    baseline_p50 = {}
    for batch_size in workload.batch_sizes_timed(list(ctx.cfg.evaluate.batch_sizes)):
        timed = [b for b in harness.batches_of(inputs, batch_size) if harness.sample_count(b) == batch_size]
        stats = benchmark.quietest(
            lambda: benchmark.measure(
                {"baseline": baseline, **runners},
                timed,  # noqa: B023
                batch_size,  # noqa: B023
                warmup=2,
                repeats=race_cfg.timing_repeats,
                budget_s=8.0,
            )
        )
        baseline_p50[str(batch_size)] = stats["baseline"]["p50_ms"]
        for entry in entries:
            entry.latency[str(batch_size)] = {
                "p50_ms": stats[entry.name]["p50_ms"],
                "x_baseline": stats["baseline"]["p50_ms"] / stats[entry.name]["p50_ms"],
                "other_cpu_share": stats["other_cpu_share"],
                "retimes": stats["retimes"],
            }
    return baseline_p50


def _baseline_runner(ctx, task):
    from engines import load_engine
    from engines.pytorch_runner import TorchRunner

    source = ctx.source
    if source.kind == "onnx":
        return load_engine(
            source.onnx_path.parent, {"format": "onnxruntime", "file": source.onnx_path.name}, threads=ctx.threads
        )
    return TorchRunner(task.module(source.module, ctx), list(task.input_names), list(task.output_names), ctx.threads)


def _size_mb(model) -> float:
    folder = model.engine_dir
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "candidate.json") / 2**20


def _choose(entries: list[Entry], ctx, workload, baseline_p50: dict) -> Entry:
    """The fastest over the workload (p50 at its one batch size, or the weighted p50 over several)
    among the candidates that pass every accuracy (and size) check of the gate, preferring those
    never slower than the baseline at any point."""
    from optimize.compile.race import pick

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
        ctx,
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
        if len(points) == 1:
            return "generation time"
        return "weighted request time (" + ", ".join(f"{p.key}: {p.weight:.2f}" for p in points) + ")"
    if len(workload.batches) == 1:
        return f"p50 at batch {workload.batches[0].batch}"
    return "weighted p50 (" + ", ".join(f"batch {p.batch}: {p.weight:.2f}" for p in workload.batches) + ")"


# ---------------------------------------------------------------- report


def _race_record(
    ctx,
    workload,
    entries: list[Entry],
    winner: Entry,
    baseline: dict,
    export: Optional[dict],
    winner_engine: Optional[dict],
    seconds: float,
) -> dict:
    from optimize.evaluate.kernels import int8_gemm_speedup

    lm = bool(winner.metrics)
    plot = _plot(entries, workload, ctx.scratch / "race_front.png")
    if plot:
        ctx.extra_files["race/front.png"] = plot
    for entry in entries:
        log.debug("race: %-28s %s", entry.name, entry.outcome)
    record = {
        "method": "auto",
        "winner": winner.name,
        "won_on": won_on(workload, lm),
        "workload": workload.record(),
        "candidates": [e.report() for e in entries],
        "close_calls": [e.name for e in entries if "within noise" in e.outcome],
        "retimed_points": _retimed_points(entries),
        "seconds": round(seconds, 1),
        "plot": "race/front.png" if plot else None,
        "winner_engine": winner_engine,
    }
    if lm:
        return {**record, "baseline": baseline}
    return {
        **record,
        "batch_size": workload.batches[0].key if len(workload.batches) == 1 else None,
        "baseline_p50_ms": baseline,
        "export": export,
        "int8_gemm": int8_gemm_speedup(ctx.threads),
    }


def _retimed_points(entries: list[Entry]) -> int:
    """Points the race timed again because other processes took CPU time (all candidates share a run)."""
    for entry in entries:
        timed = entry.latency or entry.metrics.get("requests") or {}
        if timed:
            return sum((t.get("retimes") or 0) > 0 for t in timed.values())
    return 0


def _plot(entries: list[Entry], workload, path: Path) -> Optional[Path]:
    """The front at every workload point: latency (causal LMs: request time) against accuracy (min
    cosine; perplexity increase), one panel per point, each candidate labelled with its size."""
    lm = any("requests" in e.metrics for e in entries)
    points = [p.key for p in (workload.requests if lm else workload.batches)]
    if lm:
        scored = [e for e in entries if "requests" in e.metrics]
    else:
        scored = [e for e in entries if "cosine_min" in e.fidelity and all(k in e.latency for k in points)]
    if not scored:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    for ax, point in zip(axes[0], points):
        for entry in scored:
            x, y = _front_xy(entry, point, lm)
            shipped = entry.outcome.startswith("won")
            ax.scatter(
                [x],
                [y],
                color="tab:green" if entry.passed else "tab:red",
                marker="*" if shipped else "o",
                s=160 if shipped else 50,
            )
            size = f" ({entry.size_mb:.0f} MB)" if entry.size_mb is not None else ""
            ax.annotate(entry.name + size, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(f"request time {point} tokens, p50 TTFT + decode (ms)" if lm else f"p50 at batch {point} (ms)")
        ax.set_ylabel("perplexity increase (%)" if lm else "min cosine vs baseline")
        ax.grid(alpha=0.3)
    fig.suptitle("engine race at each workload point: green passes accuracy, red fails, star ships")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _front_xy(entry: Entry, point: str, lm: bool) -> tuple[float, float]:
    if lm:
        return entry.metrics["requests"][point]["request_ms"], entry.metrics["perplexity_increase_pct"]
    return entry.latency[point]["p50_ms"], entry.fidelity["cosine_min"]


class _progress:
    """A progress bar on a terminal (tqdm), nothing in logs and CI."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=not sys.stderr.isatty(), leave=False)

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        self.bar.close()
        return False
