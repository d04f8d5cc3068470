"""The harness: baseline and candidate run on the same inputs for fidelity, latency, size and peak memory."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.runners import TensorRunner
from optimize.evaluate import benchmark
from optimize.evaluate.fidelity import embedding_fidelity, output_fidelity

log = logging.getLogger(__name__)
FIDELITY_BATCH = 16


@dataclass
class Subject:
    """One side of the comparison: what it is, how to run it, and how to rebuild it in a probe."""

    label: str
    runner: TensorRunner  # a causal LM's is a CausalLMRunner too (engines/runners.py)
    engine: dict  # engine block, loadable by engines.load_engine(root, engine)
    root: Path
    size_bytes: int
    layer_precision: dict = field(default_factory=dict)  # {precision: {count, nodes}} where a stage said
    # What was already measured of this side earlier in the run, on this machine (the LM race's
    # baseline: perplexity by the sha256 of the ids it was scored on, timings by request shape), so the
    # evaluation does not measure it again.
    measured: dict = field(default_factory=dict)


def sample_count(inputs: dict[str, np.ndarray]) -> int:
    """Samples in a batch: axis 0 of the first input, or the axis its `batch_axes` names
    (optimize.inputs.encoder.Batch: a recurrent state has its samples on axis 1, a sample rate on none)."""
    axes = getattr(inputs, "batch_axes", {})
    name, array = next((k, v) for k, v in inputs.items() if axes.get(k, 0) is not None)
    return array.shape[axes.get(name, 0)]


def batches_of(inputs: dict[str, np.ndarray], batch_size: int) -> list[dict[str, np.ndarray]]:
    axes = getattr(inputs, "batch_axes", None)
    if axes is None:
        n = len(next(iter(inputs.values())))
        return [{k: v[i : i + batch_size] for k, v in inputs.items()} for i in range(0, n, batch_size)]

    def cut(name: str, array: np.ndarray, start: int) -> np.ndarray:
        axis = axes.get(name, 0)
        if axis is None:
            return array
        return array[(slice(None),) * axis + (slice(start, start + batch_size),)]

    n = sample_count(inputs)
    kind: Any = type(inputs)  # optimize.inputs.encoder.Batch, kept so every piece still says its batch axes
    return [kind({k: cut(k, v, i) for k, v in inputs.items()}, axes) for i in range(0, n, batch_size)]


def run_all(runner, batches: list[dict]) -> dict[str, np.ndarray]:
    """Run every batch and join outputs along axis 0 (padded sequence axes may differ per batch,
    so only outputs without a sequence axis are joined; others are kept per batch)."""
    outs = [runner(b) for b in batches]
    joined = {}
    for name in outs[0]:
        parts = [o[name] for o in outs]
        if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
            joined[name] = np.concatenate(parts)
    return joined


def compare_outputs(
    baseline: Subject, candidate: Subject, inputs: dict[str, np.ndarray], task_output: str | None, top_k: int
) -> dict:
    batches = batches_of(inputs, FIDELITY_BATCH)
    return fidelity_of(run_all(baseline.runner, batches), run_all(candidate.runner, batches), task_output, top_k)


def fidelity_of(base: dict[str, np.ndarray], cand: dict[str, np.ndarray], task_output: str | None, top_k: int) -> dict:
    """The task's deciding output compared (embeddings: cosine and retrieval), or every output."""
    if task_output:
        return embedding_fidelity(base[task_output], cand[task_output], top_k)
    return output_fidelity(base, cand)


def latency(
    baseline: Subject, candidate: Subject, inputs: dict[str, np.ndarray], cfg, batch_sizes: list[int] | None = None
) -> dict[str, dict]:
    """Per batch size (evaluate.batch_sizes, or every point of the workload): both runners'
    percentiles and the candidate's speedup at p50, timed again while the machine was busy."""
    results = {}
    for batch_size in batch_sizes or cfg.batch_sizes:
        batches = [b for b in batches_of(inputs, batch_size) if sample_count(b) == batch_size]
        if not batches:
            raise ValueError(f"evaluation set too small for batch size {batch_size}")
        runners: dict[str, Any] = {"baseline": baseline.runner, "candidate": candidate.runner}
        stats: dict[str, Any] = benchmark.quietest(
            lambda: benchmark.measure(runners, batches, batch_size, cfg.warmup, cfg.repeats),  # noqa: B023
            cfg.retimes,
        )
        stats["speedup"] = stats["baseline"]["p50_ms"] / stats["candidate"]["p50_ms"]
        results[str(batch_size)] = stats
        log.debug(
            "batch %d: baseline p50 %.2f ms, candidate p50 %.2f ms, speedup %.2fx",
            batch_size,
            stats["baseline"]["p50_ms"],
            stats["candidate"]["p50_ms"],
            stats["speedup"],
        )
    return results


def peak_memory_mb(subject: Subject, batch: dict[str, np.ndarray], scratch: Path, threads: int) -> float:
    """Run the subject alone in a fresh interpreter on one batch; see engines/memprobe.py."""
    inputs_path = scratch / f"memprobe-{subject.label}.npz"
    np.savez(inputs_path, **batch)  # type: ignore[arg-type]  # numpy stubs type **kwds as bool
    engine = dict(subject.engine, threads=threads)
    proc = subprocess.run(
        [sys.executable, "-m", "engines.memprobe", str(subject.root), json.dumps(engine), str(inputs_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe of the {subject.label} failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_memory_mb"]


def shared_metrics(
    baseline: Subject,
    candidate: Subject,
    inputs: dict[str, np.ndarray],
    cfg,
    scratch: Path,
    batch_sizes: list[int] | None = None,
) -> dict:
    """What every task reports: size on disk, latency per batch size (with speedup), peak memory.
    batch_sizes: every batch size to time (default evaluate.batch_sizes)."""
    metrics: dict[str, dict[str, Any]] = {
        "baseline": {"size_mb": baseline.size_bytes / 2**20},
        "candidate": {"size_mb": candidate.size_bytes / 2**20},
    }
    batch_sizes = batch_sizes or list(cfg.batch_sizes)
    if cfg.latency:
        per_batch = latency(baseline, candidate, inputs, cfg, batch_sizes)
        for side in ("baseline", "candidate"):
            metrics[side]["latency"] = {b: s[side] for b, s in per_batch.items()}
        metrics["candidate"]["speedup"] = {b: s["speedup"] for b, s in per_batch.items()}
        metrics["candidate"]["timing"] = timing_record(per_batch)
    if cfg.memory:
        largest = batches_of(inputs, max(batch_sizes))[0]
        for side, subject in (("baseline", baseline), ("candidate", candidate)):
            metrics[side]["peak_memory_mb"] = peak_memory_mb(subject, largest, scratch, cfg.threads)
    return metrics


def timing_record(per_point: dict[str, dict]) -> dict:
    """The conditions latency was timed in: the busiest point's share of the CPUs taken by other
    processes (the gate's test), each point's, and how many points were timed again for it."""
    return {
        "other_cpu_share": max(s["other_cpu_share"] for s in per_point.values()),
        "points": {k: s["other_cpu_share"] for k, s in per_point.items()},
        "retimed_points": sum(s.get("retimes", 0) > 0 for s in per_point.values()),
        "retimes": {k: s.get("retimes", 0) for k, s in per_point.items()},
    }


def compare_runners(baseline: Subject, candidate: Subject, ctx, task_output: str | None) -> tuple[dict, dict]:
    """Evaluate two runners on the same inputs: evaluation text (tokenized by the artifact's own
    tokenizer) or, when the recipe asks, random tensors shaped from the model's signature."""
    cfg = ctx.plan.evaluate
    inputs, described = evaluation_inputs(ctx, candidate.runner)
    batch_sizes = ctx.plan.workload.batch_sizes_timed(list(cfg.batch_sizes))
    metrics = shared_metrics(baseline, candidate, inputs, cfg, ctx.scratch, batch_sizes)
    batches = batches_of(inputs, FIDELITY_BATCH)
    base, cand = run_all(baseline.runner, batches), run_all(candidate.runner, batches)
    judged = chosen_outputs(base, (cfg.task_params or {}).get("outputs"))
    metrics["candidate"]["fidelity"] = fidelity_of(
        {k: base[k] for k in judged}, {k: cand[k] for k in judged}, task_output, cfg.top_k
    )
    mask = mask_metrics(base, cand, cfg.task_params)
    if mask is not None:
        metrics["candidate"]["fidelity"]["mask"] = mask
    return metrics, described


def chosen_outputs(outputs: dict, named) -> list[str]:
    """The outputs fidelity judges: every one, or those evaluate.task_params.outputs names (a
    recurrent model's next state is an input to the next call, not a result)."""
    from optimize.errors import RecipeError

    if not named:
        return list(outputs)
    missing = [n for n in named if n not in outputs]
    if missing:
        raise RecipeError(f"evaluate.task_params.outputs names {missing}; the model's outputs are {sorted(outputs)}")
    return list(named)


def mask_metrics(base: dict, cand: dict, task_params) -> dict | None:
    """Mask IoU and pixel agreement of a map output when the recipe names one
    (evaluate.task_params: {mask_output: NAME, mask_threshold: 0.5})."""
    from optimize.errors import RecipeError
    from optimize.evaluate.fidelity import mask_agreement

    name = (task_params or {}).get("mask_output")
    if name is None:
        return None
    if name not in base:
        raise RecipeError(f"evaluate.task_params.mask_output={name}: the model's outputs are {sorted(base)}")
    return dict(mask_agreement(base[name], cand[name], float(task_params.get("mask_threshold", 0.5))), output=name)


def evaluation_inputs(ctx, runner) -> tuple[dict[str, np.ndarray], dict]:
    """(inputs, what they are): evaluation items encoded by the artifact's own tokenizer or the task's
    encoder, or, when the recipe asks, random tensors shaped by the recipe's `model.inputs` and the
    rules in optimize/inputs/plan.py (never a guessed size)."""
    cfg = ctx.plan.evaluate
    if cfg.inputs == "random":
        inputs = random_inputs(ctx, runner, cfg.data.count, cfg.data.seed)
        return inputs, {"source": "random", "count": cfg.data.count, "seed": cfg.data.seed}
    data = ctx.evaluation_data()
    ctx.refuse_text_for_tensors(data, "evaluate.data.source")
    return ctx.encode(data.items), data.describe()


def random_inputs(ctx, runner, count: int, seed: int) -> dict[str, np.ndarray]:
    """Random tensors from the context's tensor encoder, or planned from the runner's signature."""
    from optimize.inputs.encoder import TensorEncoder
    from optimize.inputs.plan import plan_inputs

    encoder = ctx.encoder if isinstance(ctx.encoder, TensorEncoder) else None
    if encoder is None:
        encoder = TensorEncoder(plan_inputs(runner.signature(), dict(ctx.plan.model.inputs), {}))
    return encoder.random(count, seed)
