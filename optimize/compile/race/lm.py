"""The engine race for causal LMs: scoring and choosing (building and caching are shared with encoders
in the other modules of this package).

Every candidate decoder is scored against the PyTorch FP32 baseline on the held-out tokens the
evaluation uses (perplexity, and lm-eval where the gate checks it). Every candidate that passes the
gate's accuracy checks is then served (`python -m serve` on loopback, race/served.py) and driven at
every request shape of the workload (`workload.requests`: prompt and output lengths with weights) and
every level of `workload.concurrency`, with successive halving; the winner is the passing candidate
with the lowest served cost: at each level its weighted request time as served over the best
candidate's, weighted over the levels. A request's time counts first token and decode together, as a
user waiting for an answer sees them: a runtime that decodes faster but prefills slower wins short
prompts and may lose long ones, and an engine that answers one request soonest but batches
statically loses a workload that is mostly sixteen clients at once.

The baseline is timed one request at a time in this process (kept in the race cache for the next race
on the same model and machine); candidates are timed only as served, where the decision is made, and
their one-client cells give the report's TTFT, decode speed and request time (as_served).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from optimize.compile.race.choice import pick
from optimize.stages import EVALUATION, stage

log = logging.getLogger(__name__)


def score(entries: list, ctx, workload, race_cfg, thresholds: dict, key_base: str | None = None) -> dict:
    """Fill each entry's `metrics` (perplexity, and lm-eval where the gate's `thresholds` check it);
    returns the baseline's, with its TTFT and decode at each request shape timed one request at a time
    in this process (candidates are timed as served: serve_passing, then as_served). With `key_base`
    (the race cache's identity of the model and machine), the baseline's figures are taken from an
    earlier race on the same data, shapes, runs and threads, or kept for the next one."""
    from engines import engine_bytes
    from optimize.compile.race import cache
    from optimize.evaluate.generation import Tokens, ids_sha256, perplexity, request_ms, timed_requests
    from optimize.tasks.causal_lm import eval_config, greedy_sample

    cfg, tokens, data = eval_config(ctx), Tokens(ctx), ctx.evaluation_data()
    ids = tokens("\n\n".join(data.items))[: cfg.perplexity_tokens]
    baseline = ctx.baseline.runner
    runs = max(2, min(ctx.plan.evaluate.repeats, race_cfg.timing_repeats, 5))
    lm_eval = thresholds.get("max_lm_eval_drop") is not None and bool(cfg.lm_eval_tasks)
    what = {"data": data.describe(), "eval": asdict(cfg), "lm_eval": lm_eval, "runs": runs, "threads": ctx.threads}
    what["shapes"] = [r.key for r in workload.requests]
    key = cache.baseline_key(key_base, what) if key_base else None
    reused = cache.load_baseline(key) if key else None
    for entry in entries:
        entry.size_mb = engine_bytes(entry.model.engine_dir, entry.model.engine) / 2**20
    base: dict[str, Any] = {
        "perplexity": reused["perplexity"] if reused else perplexity(baseline, ids, cfg.perplexity_window)
    }
    fidelity = _fidelity_reference(ctx, cfg, tokens, baseline, key)
    lm_eval_side = (baseline, tokens, data.items, reused) if lm_eval else None
    for number, entry in enumerate(entries, 1):
        log.info("race: scoring %s (%d/%d)", entry.name, number, len(entries))
        _score_candidate(entry, ctx, fidelity, ids, base, cfg, thresholds, lm_eval_side)
    if reused:
        log.info("race: the baseline's perplexity and timings are reused from an earlier race on this machine")
        on_baseline = {r.key: reused["requests"][r.key] for r in workload.requests}
    else:
        timed = timed_requests(
            {"baseline": baseline}, tokens, data.items, workload.requests, 1, runs, ctx.plan.evaluate.retimes
        )
        on_baseline = {r.key: timed[r.key]["runs"]["baseline"] for r in workload.requests}
    # Its sample now, while its weight pages are read in: the final evaluation reads it from `measured`
    # (a race cache entry kept before samples were kept has none).
    sample = (reused or {}).get("sample") or greedy_sample(baseline, tokens, cfg)
    if key and not reused:
        cache.save_baseline(
            key,
            {
                "perplexity": base["perplexity"],
                "lm_eval": base.get("lm_eval"),
                "requests": on_baseline,
                "sample": sample,
            },
        )
    base.update(
        requests={
            r.key: {"generation": on_baseline[r.key], "request_ms": request_ms(on_baseline[r.key], r.output)}
            for r in workload.requests
        },
        generation=on_baseline[workload.requests[0].key],
        reused=bool(reused),
    )
    # The evaluation after the race reads these instead of scoring and timing the baseline again.
    ctx.baseline.measured = {
        "perplexity": {"sha256": ids_sha256(ids), "window": cfg.perplexity_window, "value": base["perplexity"]},
        "requests": on_baseline,
        "sample": sample,
        "runs": runs,
        "by": "an earlier race on this machine (the race cache)" if reused else "the engine race, earlier in this run",
    }
    if fidelity is not None:
        ctx.baseline.measured["fidelity_reference"] = {
            "identity": fidelity["identity"],
            "reference": fidelity["reference"],
        }
    standard = _standard_reference(ctx, cfg, tokens, baseline, key_base)
    if standard is not None:
        ctx.baseline.measured["standard_tasks"] = standard
    return base


# ---------------------------------------------------------------- the fidelity screen


def _fidelity_reference(ctx, cfg, tokens, baseline, key: str | None) -> dict | None:
    """The baseline's log-probs over all the fidelity tokens (the final evaluation reads them from
    ctx.baseline.measured), from the race cache when an earlier race on this model and machine kept
    them, else computed now and kept; None when fidelity is not measured."""
    if not cfg.fidelity_tokens:
        return None
    from optimize.tasks.lm_fidelity import baseline_reference, fidelity_texts

    texts = fidelity_texts(tokens, cfg)
    cached = _load_reference(key, texts, cfg) if key else None
    if cached is not None:
        reference, identity = cached
    else:
        reference, identity = baseline_reference(baseline, texts, cfg, {})
        if key:
            _save_reference(key, identity, reference)
    return {"texts": texts, "reference": reference, "identity": identity}


def _standard_reference(ctx, cfg, tokens, baseline, key_base: str | None) -> dict | None:
    """The baseline's per-item scores on the standard tasks, which the final evaluation reads from
    ctx.baseline.measured: from the race cache where an earlier race on this model and machine scored
    the same items, else scored now (once a run) and kept; None when no standard task is asked."""
    if not cfg.standard_tasks:
        return None
    from optimize.compile.race import cache
    from optimize.tasks.lm_fidelity import task_scores
    from optimize.tasks.lm_harness import standard_task_data

    folder = ctx.scratch / "standard_tasks"
    written = standard_task_data(cfg.standard_tasks, cfg.standard_limit, folder)
    identity = {name: entry["sha256"] for name, entry in written.items()}
    asked = {"standard_tasks": identity, "task_precision": cfg.task_precision}
    key = cache.baseline_key(key_base, asked) if key_base else None
    cached = cache.load_baseline(key) if key else None
    if cached is not None and cached.get("written") == identity:
        log.info("race: the baseline's standard-task scores are reused from an earlier race on this machine")
        return cached
    entry = {"written": identity, **task_scores(baseline, tokens, cfg, folder, "baseline")}
    if key:
        cache.save_baseline(key, entry)
    return entry


def _reference_folder(key: str, identity: str):
    from optimize.sources.models import cache_root

    return cache_root() / "race" / f"fidelity-{key}-{identity[:16]}"


def _load_reference(key: str, texts: dict, cfg):
    from optimize import cache_store
    from optimize.evaluate.token_fidelity import Reference, reference_identity

    identity = reference_identity(texts, cfg.fidelity_window, cfg.fidelity_top_k)
    where = _reference_folder(key, identity)
    good, why = cache_store.open_verified(where, identity)
    if good:
        try:
            return Reference.load(where / "reference.npz"), identity
        except (OSError, ValueError, KeyError) as exc:
            why = f"its reference.npz is unreadable ({type(exc).__name__})"
    if why != "not cached":
        log.warning("race: cached baseline log-probs %s not used, computed again: %s", where.name, why)
        cache_store.discard(where)
    return None


def _save_reference(key: str, identity: str, reference) -> None:
    from optimize import cache_store

    where = _reference_folder(key, identity)
    tmp = cache_store.staging(where)
    reference.save(tmp / "reference.npz")
    cache_store.seal(tmp, where, identity)


def _screen(fidelity: dict, runner, cfg) -> dict:
    """The candidate's fidelity on the first fidelity_screen_tokens of the texts (all of them with 0):
    what the race judges the gate's fidelity checks on before perplexity, lm-eval and serving."""
    from optimize.evaluate import token_fidelity as tf
    from optimize.tasks.lm_fidelity import screen_texts

    texts, reference = fidelity["texts"], fidelity["reference"]
    if cfg.fidelity_screen_tokens:
        texts = screen_texts(texts, cfg.fidelity_screen_tokens)
        reference = reference.prefix_of(fidelity["texts"], texts, cfg.fidelity_window)
    with stage(EVALUATION + "fidelity screen"):
        figures = tf.compare(reference, runner, texts, cfg.fidelity_window)
    figures["screen"] = True
    return figures


def _screened_out(entry, thresholds: dict) -> bool:
    """The screen's fidelity fails a gate check: lm-eval and serving would be spent on a loser."""
    fidelity = entry.metrics.get("fidelity") or {}
    keys = {"max_mean_kld": "mean_kld", "max_p99_kld": "p99_kld", "max_rms_delta_p_pct": "rms_delta_p_pct"}
    for key, figure in keys.items():
        if thresholds.get(key) is not None and figure in fidelity and fidelity[figure] > thresholds[key]:
            return True
    floor = thresholds.get("min_top1_agreement")
    return floor is not None and "top1_agreement" in fidelity and fidelity["top1_agreement"] < floor


def as_served(entries: list, workload, baseline: dict) -> None:
    """Each served entry's figures one request at a time, read from its served cells at the fewest
    clients the workload declares (one, by default): TTFT p50, decode tok/s (from the median gap
    between streamed tokens) and request time at each shape, and its decode speed over the baseline's
    (timed in process: the candidate's figure carries HTTP's cost too, so the ratio errs low). Timing
    every candidate in process as well doubled the race's timing for no decision: what ships is judged
    as served."""
    fewest = min(workload.concurrency, key=lambda c: c.clients).key
    for entry in entries:
        served = entry.metrics.get("served")
        if not served:
            continue
        requests = {}
        for shape in workload.requests:
            cell = served[shape.key][fewest]
            decode, read_from = _served_decode(cell)
            if decode is None:
                continue
            generation = {
                "ttft_ms": {"p50": cell["ttft_p50_ms"]},
                "decode_tok_s": {"p50": decode},
                "decode_read_from": read_from,
                "as_served_clients": int(fewest),
            }
            speedup = decode / baseline["requests"][shape.key]["generation"]["decode_tok_s"]["p50"]
            requests[shape.key] = {
                "generation": generation,
                "request_ms": cell["request_ms"],
                "decode_speedup": speedup,
            }
        entry.metrics["requests"] = requests
        head = requests.get(workload.requests[0].key)
        if head is not None:
            entry.metrics.update(
                generation=head["generation"], generation_ms=head["request_ms"], decode_speedup=head["decode_speedup"]
            )
        entry.metrics["other_cpu_share"] = max(c["other_cpu_share"] for by in served.values() for c in by.values())


def _served_decode(cell: dict) -> tuple[float | None, str]:
    """Decode tok/s of a served cell: from the median gap between streamed text chunks, or where the
    stream gave no gaps (replies of one chunk, or tokens that detokenize to no text, as a random tiny
    model's often do) from the mean request: its tokens after the first over the time after the first
    chunk, or over the whole request where no chunk came (prefill included, so it errs low)."""
    if cell.get("request_ms") is None:
        return None, ""
    if cell.get("itl_p50_ms"):
        return 1e3 / cell["itl_p50_ms"], "inter-token gap p50"
    tokens = (cell.get("output_tokens") or 0) / max(1, cell.get("requests") or 0)
    after_first = cell["request_ms"] - (cell.get("ttft_p50_ms") or 0.0)
    if cell.get("ttft_p50_ms") and tokens > 1 and after_first > 0:
        return 1e3 * (tokens - 1) / after_first, "mean request after the first token"
    if tokens > 0 and cell["request_ms"] > 0:
        return 1e3 * tokens / cell["request_ms"], "mean request, prefill included"
    return None, ""


def _score_candidate(entry, ctx, fidelity: dict | None, ids, base: dict, cfg, thresholds: dict, lm_eval_side) -> None:
    """The candidate's fidelity screen and perplexity against the baseline's, then its lm-eval drop
    where `lm_eval_side` (the baseline, tokens, texts and cached figures it needs) is given and the
    screen passed it. Its engine is loaded here and freed on return, so one candidate's weights at a
    time sit beside the baseline: at 1B parameters and more, every candidate's at once would be the
    run's peak (optimize/memory/plan.py)."""
    import gc

    from engines import load_engine
    from optimize.evaluate.generation import perplexity
    from optimize.evaluate.idle import baseline_idles

    baseline_idles(ctx.baseline, f"{entry.name} is scored")  # against the reference; lm-eval reads it again once
    runner = load_engine(entry.model.engine_dir, entry.model.engine, threads=ctx.threads)
    entry.metrics = {}
    if fidelity is not None:
        entry.metrics["fidelity"] = _screen(fidelity, runner, cfg)
    ppl = perplexity(runner, ids, cfg.perplexity_window)
    entry.metrics.update(perplexity=ppl, perplexity_increase_pct=(ppl / base["perplexity"] - 1) * 100)
    if lm_eval_side is not None and not _screened_out(entry, thresholds):  # the race's costliest scoring
        _lm_eval(entry, runner, base, cfg, ctx, *lm_eval_side)
    del runner
    gc.collect()


def _lm_eval(entry, runner, base: dict, cfg, ctx, baseline, tokens, paragraphs, reused: dict | None) -> None:
    """The candidate's lm-eval drop; the baseline's scores first, once a race (or from the race cache)."""
    from optimize.tasks.lm_harness import lm_eval_accuracy, lm_eval_drop

    if "lm_eval" not in base:
        if reused and reused.get("lm_eval") is not None:
            base["lm_eval"] = reused["lm_eval"]
        else:
            base["lm_eval"], _ = lm_eval_accuracy(baseline, tokens, paragraphs, cfg, ctx.scratch, "baseline")
    scores, _ = lm_eval_accuracy(runner, tokens, paragraphs, cfg, ctx.scratch, entry.name)
    entry.metrics.update(lm_eval=scores, lm_eval_drop_pts=lm_eval_drop(base["lm_eval"], scores))


def serve_passing(entries: list, ctx, workload, thresholds: dict, baseline: dict) -> dict:
    """Time every candidate that passes accuracy as served, at each shape and concurrency level
    (race/served.py, with successive halving); returns the halving record for the race's."""
    from optimize.compile.race.served import time_served
    from optimize.evaluate.idle import baseline_idles

    passing = [e for e in entries if accuracy_verdict(e, thresholds).passed]
    if not passing:
        return {"rounds": [], "cut": {}}
    baseline_idles(ctx.baseline, "the candidates are served")
    record = time_served(passing, ctx, workload)
    as_served(passing, workload, baseline)
    return record


def accuracy_verdict(entry, thresholds: dict):
    """The gate's accuracy and size checks on one candidate (what pick judges)."""
    from optimize import gate

    return gate.judge({}, {**entry.metrics, "size_mb": entry.size_mb}, thresholds)


def choose(entries: list, workload, baseline: dict, thresholds: dict):
    """The candidate with the lowest served cost (served_costs) among those that pass every accuracy
    and size check of the gate (perplexity increase, lm-eval drop, size), preferring those never
    slower than the baseline at any shape with one client; none passing: the lowest perplexity ships."""
    from optimize.compile.race.served import load_failure, served_costs

    served = [e for e in entries if "served" in e.metrics and not e.served_cut]
    cut = [e for e in entries if e.served_cut]
    pool = [e for e in entries if not e.served_cut]
    if served:
        for name, value in served_costs(served, workload).items():
            next(e for e in served if e.name == name).cost = value
    mix = ", ".join(f"{c.clients} clients: {c.weight:.2f}" for c in workload.concurrency)
    winner = pick(
        pool,
        thresholds,
        measured=lambda e: e.metrics,
        cost=lambda e: e.cost if e.cost is not None else float("inf"),  # passing yet not served: never
        error=lambda e: e.metrics["perplexity"],
        cost_words=(f"lowest served cost ({mix})", "served cost"),
        per_point=_per_point,
        baseline={f"{p.key} tokens at 1 clients": baseline["requests"][p.key]["request_ms"] for p in workload.requests},
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


def _per_point(entry) -> dict:
    """Request time as served at each shape and level (the baseline's one request at a time is
    compared with the one-client cells)."""
    points = {}
    for shape, levels in (entry.metrics.get("served") or {}).items():
        for level, cell in levels.items():
            points[f"{shape} tokens at {level} clients"] = cell["request_ms"] or float("inf")
    return points
