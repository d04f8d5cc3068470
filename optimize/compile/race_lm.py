"""The engine race for causal LMs: scoring and choosing (building and caching are shared with encoders
in auto.py).

Every candidate decoder is scored against the PyTorch FP32 baseline on the held-out tokens the
evaluation uses (perplexity, and lm-eval where the gate checks it), then every candidate and the
baseline generate the same prompts in turn (time to first token and decode tokens/s), each candidate
in a process of its own with only its runtime loaded, as a server runs it. The winner
is the candidate that passes the gate's accuracy checks with the shortest generation of the
evaluation's prompt and new tokens: TTFT + (new_tokens - 1) / decode, so first token and decode
count together, as a user waiting for an answer sees them.
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger(__name__)


def score(entries: list, ctx) -> dict:
    """Fill each entry's `metrics` (perplexity, lm-eval, TTFT, decode); returns the baseline's."""
    from engines import load_engine
    from engines.pytorch_runner import TorchLM
    from engines.runner_process import RunnerProcess
    from optimize.evaluate.benchmark import OtherCpuUse
    from optimize.tasks.causal_lm import Tokens, eval_config, perplexity, speed

    cfg, tokens, data = eval_config(ctx), Tokens(ctx), ctx.evaluation_data()
    ids = tokens("\n\n".join(data.items))[: cfg.perplexity_tokens]
    baseline = TorchLM(ctx.source.module, ctx.threads)
    runners = {e.name: load_engine(e.model.engine_dir, e.model.engine, threads=ctx.threads) for e in entries}
    for entry in entries:
        entry.size_mb = sum(p.stat().st_size for p in entry.model.engine_dir.rglob("*") if p.is_file()) / 2**20
    base = {"perplexity": perplexity(baseline, ids, cfg.perplexity_window)}
    for entry in entries:
        ppl = perplexity(runners[entry.name], ids, cfg.perplexity_window)
        entry.metrics = {"perplexity": ppl, "perplexity_increase_pct": (ppl / base["perplexity"] - 1) * 100}
    if ctx.cfg.gate.max_lm_eval_drop is not None and cfg.lm_eval_tasks:
        _lm_eval(entries, runners, baseline, base, tokens, data.items, cfg, ctx)
    prompts = [p[: cfg.prompt_tokens] for p in map(tokens, data.items) if len(p) >= cfg.prompt_tokens]
    runs = max(2, min(ctx.cfg.evaluate.repeats, ctx.cfg.engine.params.timing_repeats, 5))
    runners.clear()  # scored; each candidate is timed in a process of its own (engines/runner_process.py)
    with contextlib.ExitStack() as stack:
        timed_runners = {
            e.name: stack.enter_context(RunnerProcess(e.model.engine_dir, e.model.engine, ctx.threads)) for e in entries
        }
        with OtherCpuUse() as others:
            timed = speed({"baseline": baseline, **timed_runners}, prompts, cfg.new_tokens, warmup=1, runs=runs)
    base["generation"] = timed["baseline"]
    for entry in entries:
        result = timed[entry.name]
        entry.metrics.update(
            generation=result,
            generation_ms=generation_ms(result, cfg.new_tokens),
            decode_speedup=result["decode_tok_s"]["p50"] / timed["baseline"]["decode_tok_s"]["p50"],
            other_cpu_share=others.share,
        )
    return base


def generation_ms(result: dict, new_tokens: int) -> float:
    """Milliseconds to answer: first token, then the rest at the median decode speed."""
    return result["ttft_ms"]["p50"] + (new_tokens - 1) / result["decode_tok_s"]["p50"] * 1000


def _lm_eval(entries, runners, baseline, base, tokens, paragraphs, cfg, ctx) -> None:
    from optimize.tasks.lm_harness import lm_eval_accuracy, lm_eval_drop

    base["lm_eval"], _ = lm_eval_accuracy(baseline, tokens, paragraphs, cfg, ctx.scratch, "baseline")
    for entry in entries:
        scores, _ = lm_eval_accuracy(runners[entry.name], tokens, paragraphs, cfg, ctx.scratch, entry.name)
        entry.metrics.update(lm_eval=scores, lm_eval_drop_pts=lm_eval_drop(base["lm_eval"], scores))


def choose(entries: list, ctx):
    """The candidate with the shortest generation among those that pass every accuracy and size check
    of the gate (perplexity increase, lm-eval drop, size); none passing: the lowest perplexity ships."""
    from optimize.compile.race import pick

    return pick(
        entries,
        ctx,
        measured=lambda e: e.metrics,
        cost=lambda e: e.metrics["generation_ms"],
        error=lambda e: e.metrics["perplexity"],
        cost_words=("shortest generation", "generation time"),
    )


def columns(entry) -> dict:
    """What the report shows of one candidate."""
    m = entry.metrics
    if not m:
        return {}
    generation = m.get("generation") or {}
    return {
        "perplexity (+%)": f"{m['perplexity']:.3f} ({m['perplexity_increase_pct']:+.1f}%)",
        "lm-eval drop pts": f"{m['lm_eval_drop_pts']:.1f}" if "lm_eval_drop_pts" in m else "-",
        "TTFT p50 ms": f"{generation['ttft_ms']['p50']:.1f}" if generation else "-",
        "decode tok/s p50 (x base)": (
            f"{generation['decode_tok_s']['p50']:.1f} ({m['decode_speedup']:.2f}x)" if generation else "-"
        ),
        "generation ms": f"{m['generation_ms']:.0f}" if "generation_ms" in m else "-",
    }
