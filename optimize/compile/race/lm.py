"""The engine race for causal LMs: scoring and choosing (building and caching are shared with encoders
in the other modules of this package).

Every candidate decoder is scored against the PyTorch FP32 baseline on the held-out tokens the
evaluation uses (perplexity, and lm-eval where the gate checks it), then every candidate and the
baseline generate the same prompts in turn (time to first token and decode tokens/s) at every request
shape of the workload (`workload.requests`: prompt and output lengths with weights), each candidate
in a process of its own with only its runtime loaded, as a server runs it; a request's time is
TTFT + (output - 1) / decode, so first token and decode count together, as a user waiting for an
answer sees them: a runtime that decodes faster but prefills slower wins short prompts and may lose
long ones.

Then every candidate that passes the gate's accuracy checks is served (`python -m serve` on loopback,
race/served.py) and driven at every shape and every level of `workload.concurrency`, with successive
halving; the winner is the passing candidate with the lowest served cost: at each level its weighted
request time as served over the best candidate's, weighted over the levels. An engine that answers
one request soonest but batches statically loses a workload that is mostly sixteen clients at once.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict
from typing import Any

from optimize.compile.race.choice import pick

log = logging.getLogger(__name__)


def score(entries: list, ctx, workload, race_cfg, thresholds: dict, key_base: str | None = None) -> dict:
    """Fill each entry's `metrics` (perplexity, lm-eval where the gate's `thresholds` check it, TTFT
    and decode at each request shape); returns the baseline's. With `key_base` (the race cache's
    identity of the model and machine), the baseline's figures are taken from an earlier race on the
    same data, shapes, runs and threads, or kept for the next one."""
    from engines import engine_bytes, load_engine
    from engines.runner_process import RunnerProcess
    from optimize.compile.race import cache
    from optimize.evaluate.generation import Tokens, perplexity, request_ms, timed_requests
    from optimize.tasks.causal_lm import eval_config

    cfg, tokens, data = eval_config(ctx), Tokens(ctx), ctx.evaluation_data()
    ids = tokens("\n\n".join(data.items))[: cfg.perplexity_tokens]
    baseline = ctx.baseline.runner
    runs = max(2, min(ctx.plan.evaluate.repeats, race_cfg.timing_repeats, 5))
    lm_eval = thresholds.get("max_lm_eval_drop") is not None and bool(cfg.lm_eval_tasks)
    what = {"data": data.describe(), "eval": asdict(cfg), "lm_eval": lm_eval, "runs": runs, "threads": ctx.threads}
    what["shapes"] = [r.key for r in workload.requests]
    key = cache.baseline_key(key_base, what) if key_base else None
    reused = cache.load_baseline(key) if key else None
    runners = {e.name: load_engine(e.model.engine_dir, e.model.engine, threads=ctx.threads) for e in entries}
    for entry in entries:
        entry.size_mb = engine_bytes(entry.model.engine_dir, entry.model.engine) / 2**20
    base: dict[str, Any] = {
        "perplexity": reused["perplexity"] if reused else perplexity(baseline, ids, cfg.perplexity_window)
    }
    for entry in entries:
        ppl = perplexity(runners[entry.name], ids, cfg.perplexity_window)
        entry.metrics = {"perplexity": ppl, "perplexity_increase_pct": (ppl / base["perplexity"] - 1) * 100}
    if lm_eval:
        _lm_eval(entries, runners, baseline, base, tokens, data.items, cfg, ctx, reused)
    runners.clear()  # scored; each candidate is timed in a process of its own (engines/runner_process.py)
    with contextlib.ExitStack() as stack:
        timed_runners = {
            e.name: stack.enter_context(RunnerProcess(e.model.engine_dir, e.model.engine, ctx.threads)) for e in entries
        }
        subjects = timed_runners if reused else {"baseline": baseline, **timed_runners}
        timed = timed_requests(subjects, tokens, data.items, workload.requests, warmup=1, runs=runs)
    if reused:
        log.info("race: the baseline's perplexity and timings are reused from an earlier race on this machine")
        for r in workload.requests:
            timed[r.key]["runs"]["baseline"] = reused["requests"][r.key]
    on_baseline = {r.key: timed[r.key]["runs"]["baseline"] for r in workload.requests}
    if key and not reused:
        cache.save_baseline(
            key, {"perplexity": base["perplexity"], "lm_eval": base.get("lm_eval"), "requests": on_baseline}
        )
    first = workload.requests[0]
    base.update(
        requests={
            r.key: {"generation": on_baseline[r.key], "request_ms": request_ms(on_baseline[r.key], r.output)}
            for r in workload.requests
        },
        generation=on_baseline[first.key],
        reused=bool(reused),
    )
    for entry in entries:
        entry.metrics["requests"] = {r.key: _at(timed[r.key], entry.name, r.output) for r in workload.requests}
        head = entry.metrics["requests"][first.key]
        entry.metrics.update(
            generation=head["generation"],
            generation_ms=head["request_ms"],
            decode_speedup=head["decode_speedup"],
            other_cpu_share=max(t["other_cpu_share"] for t in timed.values()),
        )
    return base


def _at(run: dict, name: str, output: int) -> dict:
    """One candidate's figures at one request shape."""
    from optimize.evaluate.generation import request_ms

    result, base = run["runs"][name], run["runs"]["baseline"]
    return {
        "generation": result,
        "request_ms": request_ms(result, output),
        "decode_speedup": result["decode_tok_s"]["p50"] / base["decode_tok_s"]["p50"],
        "other_cpu_share": run["other_cpu_share"],
        "retimes": run["retimes"],
    }


def generation_ms(result: dict, new_tokens: int) -> float:
    """Milliseconds to answer: first token, then the rest at the median decode speed."""
    from optimize.evaluate.generation import request_ms

    return request_ms(result, new_tokens)


def _lm_eval(entries, runners, baseline, base, tokens, paragraphs, cfg, ctx, reused: dict | None) -> None:
    from optimize.tasks.lm_harness import lm_eval_accuracy, lm_eval_drop

    if reused and reused.get("lm_eval") is not None:
        base["lm_eval"] = reused["lm_eval"]
    else:
        base["lm_eval"], _ = lm_eval_accuracy(baseline, tokens, paragraphs, cfg, ctx.scratch, "baseline")
    for entry in entries:
        scores, _ = lm_eval_accuracy(runners[entry.name], tokens, paragraphs, cfg, ctx.scratch, entry.name)
        entry.metrics.update(lm_eval=scores, lm_eval_drop_pts=lm_eval_drop(base["lm_eval"], scores))


def serve_passing(entries: list, ctx, workload, thresholds: dict) -> dict:
    """Time every candidate that passes accuracy as served, at each shape and concurrency level
    (race/served.py, with successive halving); returns the halving record for the race's."""
    from optimize.compile.race.served import time_served

    passing = [e for e in entries if accuracy_verdict(e, thresholds).passed]
    if not passing:
        return {"rounds": [], "cut": {}}
    return time_served(passing, ctx, workload)


def accuracy_verdict(entry, thresholds: dict):
    """The gate's accuracy and size checks on one candidate (what pick judges)."""
    from optimize import gate

    return gate.judge({}, {**entry.metrics, "size_mb": entry.size_mb}, thresholds)


def choose(entries: list, workload, baseline: dict, thresholds: dict):
    """The candidate with the lowest cost over the workload among those that pass every accuracy and
    size check of the gate (perplexity increase, lm-eval drop, size), preferring those never slower
    than the baseline at any shape; none passing: the lowest perplexity ships. The cost is the served
    one (served_costs) where the passing candidates were timed as served, else the request time
    (weighted over the shapes) one request at a time."""
    from optimize.compile.race.served import load_failure, served_costs

    points = workload.requests
    served = [e for e in entries if "served" in e.metrics and not e.served_cut]
    cut = [e for e in entries if e.served_cut]
    pool = [e for e in entries if not e.served_cut]
    words = ("shortest generation", "generation time")
    if served:
        for name, value in served_costs(served, workload).items():
            next(e for e in served if e.name == name).cost = value
        mix = ", ".join(f"{c.clients} clients: {c.weight:.2f}" for c in workload.concurrency)
        words = (f"lowest served cost ({mix})", "served cost")
    elif len(points) > 1:
        for entry in entries:
            entry.cost = sum(p.weight * entry.metrics["requests"][p.key]["request_ms"] for p in points)
        words = ("shortest weighted request time", "weighted request time")
    winner = pick(
        pool,
        thresholds,
        measured=lambda e: e.metrics,
        cost=lambda e: e.cost if e.cost is not None else e.metrics["generation_ms"],
        error=lambda e: e.metrics["perplexity"],
        cost_words=words,
        per_point=lambda e: _per_point(e, workload),
        baseline={f"{p.key} tokens": baseline["requests"][p.key]["request_ms"] for p in points},
    )
    for entry in cut:
        verdict = accuracy_verdict(entry, thresholds)
        entry.accuracy_checks, entry.passed = [asdict(c) for c in verdict.checks], verdict.passed
        entry.outcome = f"lost: cut after the first served round ({entry.served_cut})"
    if cut and winner.outcome.startswith("won"):
        winner.outcome += f" and were timed to the end ({len(cut)} more cut after the first served round)"
    for entry in served:  # timed to the end, yet a request failed: its cost is infinite, say why
        failure = load_failure(entry, workload)
        if failure is not None and entry.outcome:
            entry.outcome += f" (its served load failed: {failure})"
    return winner


def _per_point(entry, workload) -> dict:
    """Request time at each shape one request at a time, and as served at each shape and level."""
    points = {f"{p.key} tokens": entry.metrics["requests"][p.key]["request_ms"] for p in workload.requests}
    for shape, levels in (entry.metrics.get("served") or {}).items():
        for level, cell in levels.items():
            points[f"{shape} tokens at {level} clients"] = cell["request_ms"] or float("inf")
    return points
