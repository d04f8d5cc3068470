"""Causal language models: the task, the GGUF -> safetensors cache, and the evaluation.

Baseline and candidate are measured in the same process, on the same token ids (tokenized once by
the artifact's tokenizer):
- perplexity on held-out text (the evaluation split, disjoint from calibration by document);
- lm-eval accuracy (its Python API) on local multiple-choice tasks made here from held-out text,
  or on standard task names when the dataset hub is reachable;
- time to first token and decode tokens/s (p50/p95 over runs) of greedy generation: PyTorch FP32
  `generate` against the artifact's engine, runs interleaved so machine noise hits both alike.

Options live in `evaluate.task_params` (see LLMEvalConfig).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, cast

import numpy as np

from optimize.errors import RecipeError
from optimize.evaluate.roofline import NOT_KNOWN
from optimize.tasks import register_task
from optimize.tasks.base import Task
from optimize.tasks.lm_harness import LOCAL_TASK, greedy_ids, lm_eval_scores

log = logging.getLogger(__name__)


@dataclass
class LLMEvalConfig:
    """evaluate.task_params for model.task=causal_lm. Example:

    evaluate:
      task_params: {perplexity_tokens: 2048, new_tokens: 64, lm_eval_tasks: [cpython_next_sentence]}
    """

    perplexity_tokens: int = 2048  # held-out tokens scored (the README figures use 2,048)
    perplexity_window: int = 512  # tokens per forward pass; each window starts without context
    prompt_tokens: int = 64  # prompt length for the speed runs (when workload.requests is not set)
    new_tokens: int = 64  # tokens generated per speed run (EOS cannot stop a run early); same
    lm_eval_tasks: List[str] = field(default_factory=lambda: [LOCAL_TASK])
    lm_eval_limit: Optional[int] = 100  # questions per task (null: all)
    sample_prompt: str = "The capital of Italy is"  # greedy continuation recorded for both sides

    def validate(self):
        if min(self.perplexity_tokens, self.perplexity_window, self.prompt_tokens) < 2 or self.new_tokens < 2:
            raise RecipeError("evaluate.task_params: token counts must be at least 2")


def eval_config(ctx) -> LLMEvalConfig:
    from omegaconf import OmegaConf

    from optimize.registry import Method, build_config

    params = cast(dict, OmegaConf.to_container(ctx.cfg.evaluate.get("task_params") or {}, resolve=True))
    method = Method("evaluate", "causal_lm", LLMEvalConfig, fn=lambda *args: None)  # only its config is built
    try:
        return build_config(method, params)
    except RecipeError as exc:  # the registry names the key as evaluate.params.*; say task_params
        raise RecipeError(str(exc).replace("evaluate.params.", "evaluate.task_params.")) from None


# ---------------------------------------------------------------- the task


@dataclass
class CausalLM(Task):
    name: str = "causal_lm"
    input_names: tuple[str, ...] = ("input_ids",)
    output_names: tuple[str, ...] = ("logits",)
    dynamic_axes: dict = field(default_factory=lambda: {"input_ids": {0: "batch", 1: "sequence"}})

    def module(self, model, ctx):
        return _LogitsModule.wrap(model)

    def evaluate(self, baseline, candidate, ctx) -> tuple[dict, dict]:
        return evaluate_causal_lm(baseline, candidate, ctx)

    def check_workload(self, ctx, workload) -> None:
        """Before any candidate is built: every request fits the model's context, and the
        evaluation text holds a prompt of every declared length."""
        context = getattr(getattr(ctx.source.module, "config", None), "max_position_embeddings", None)
        tokens = Tokens(ctx)
        for request in workload.requests:
            if context is not None and request.prompt + request.output > context:
                raise RecipeError(
                    f"workload.requests: {request.prompt} prompt + {request.output} output tokens do not fit "
                    f"the model's context of {context} tokens"
                )
            prompts_of(tokens, ctx.evaluation_data().items, request.prompt)


class _LogitsModule:
    """forward(input_ids) -> logits: the positional interface TorchRunner and exporters expect."""

    @staticmethod
    def wrap(model):
        import torch

        class Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lm = model

            def forward(self, input_ids):
                return self.lm(input_ids=input_ids, use_cache=False).logits

        return Logits().eval()


register_task(CausalLM())


# ---------------------------------------------------------------- evaluation


class Tokens:
    """The artifact's own tokenizer (tokenizers library), without truncation or padding."""

    def __init__(self, ctx):
        if ctx.encoder is None:
            raise RecipeError("model.task=causal_lm needs a tokenizer in the model folder")
        import copy

        self.tokenizer = copy.deepcopy(ctx.encoder.tokenizer)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def perplexity(runner, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) over consecutive windows of the token stream."""
    logprobs = [
        runner.log_likelihood(ids[i : i + window])
        for i in range(0, len(ids) - 1, window)
        if len(ids[i : i + window]) > 1
    ]
    return float(np.exp(-np.concatenate(logprobs).mean()))


def percentiles(values) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}


# Untimed tokens each runner generates right before each timed run. Runtimes keep their worker
# threads spinning for a while after a call (ONNX Runtime's pool, OpenMP's, TBB's); timed right after
# another runtime, a runner shares the 2 cores with those threads. A short untimed generation first
# lets them go idle and wakes the runner's own.
SETTLE_TOKENS = 8


def speed(runners: dict, prompts: list[list[int]], new_tokens: int, warmup: int, runs: int) -> dict:
    """TTFT and decode tokens/s per runner over `runs` timed generations (after `warmup`), interleaved
    and in alternating order, each after an untimed settling generation (SETTLE_TOKENS). Decode speed
    of a run = (n - 1) / (time of token n - time of token 1). The p95 of tokens/s is the slow tail:
    the 5th percentile of per-run tokens/s."""
    samples: dict[str, dict[str, list[float]]] = {name: {"ttft_ms": [], "tok_s": []} for name in runners}
    names = list(runners)
    for i in range(warmup + runs):
        prompt = prompts[i % len(prompts)]
        for name in names if i % 2 == 0 else names[::-1]:
            runners[name].timed_stream(prompts[(i + 1) % len(prompts)], SETTLE_TOKENS)
            start = time.perf_counter()
            stamps = runners[name].timed_stream(prompt, new_tokens)
            if i >= warmup:
                samples[name]["ttft_ms"].append((stamps[0] - start) * 1000)
                samples[name]["tok_s"].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {
        name: {
            "ttft_ms": percentiles(s["ttft_ms"]),
            "decode_tok_s": {"p50": float(np.percentile(s["tok_s"], 50)), "p95": float(np.percentile(s["tok_s"], 5))},
            "runs": runs,
            "new_tokens": new_tokens,
            "prompt_tokens": len(prompts[0]),
        }
        for name, s in samples.items()
    }


def prompts_of(tokens: Tokens, items: list[str], length: int) -> list[list[int]]:
    """Prompts of exactly `length` tokens from the evaluation text: the start of each item that long,
    else (a long prompt, longer than any paragraph) consecutive pieces of the items joined."""
    per_item = [ids[:length] for ids in map(tokens, items) if len(ids) >= length]
    if per_item:
        return per_item
    joined = tokens("\n\n".join(items))
    if len(joined) < length:
        raise RecipeError(
            f"workload.requests: a {length}-token prompt needs more evaluation text than the "
            f"{len(joined)} tokens there are: raise evaluate.data.count"
        )
    return [joined[i : i + length] for i in range(0, len(joined) - length + 1, length)]


def timed_requests(runners: dict, tokens: Tokens, items: list[str], requests, warmup: int, runs: int) -> dict:
    """{shape key: the quietest speed() run of that request shape (timed again while other
    processes took more than benchmark.RETIME_SHARE of the CPUs), with other_cpu_share, retimes}."""
    from optimize.evaluate.benchmark import OtherCpuUse, quietest

    def once(prompts: list[list[int]], output: int) -> dict:
        with OtherCpuUse() as others:
            result = speed(runners, prompts, output, warmup, runs)
        return {"runs": result, "other_cpu_share": others.share}

    timed = {}
    for request in requests:
        prompts = prompts_of(tokens, items, request.prompt)
        log.info("greedy generation %s: %d runs per side", request.key, runs)
        timed[request.key] = quietest(lambda: once(prompts, request.output))  # noqa: B023
    return timed


def request_ms(result: dict, new_tokens: int) -> float:
    """Milliseconds to answer: first token, then the rest at the median decode speed."""
    return result["ttft_ms"]["p50"] + (new_tokens - 1) / result["decode_tok_s"]["p50"] * 1000


def evaluate_causal_lm(baseline, candidate, ctx) -> tuple[dict, dict]:
    from engines.pytorch_runner import TorchLM
    from optimize import workload

    cfg = eval_config(ctx)
    data = ctx.evaluation_data()
    tokens = Tokens(ctx)
    requests = workload.resolve(ctx.cfg).requests

    base = TorchLM(ctx.source.module, ctx.threads)
    cand = candidate.runner
    metrics: dict[str, Any] = {
        "baseline": {"size_mb": baseline.size_bytes / 2**20},
        "candidate": {"size_mb": candidate.size_bytes / 2**20},
    }
    described = dict(data.describe())
    _perplexity_metrics(metrics, base, cand, tokens, data.items, cfg, described)
    _sample_metrics(metrics, base, cand, tokens, cfg)
    if ctx.cfg.evaluate.latency:
        from engines.runner_process import RunnerProcess

        # Timed in a process of its own, with only its runtime loaded (engines/runner_process.py).
        with RunnerProcess(candidate.root, candidate.engine, ctx.threads) as timed:
            _speed_metrics(metrics, base, timed, tokens, data.items, requests, ctx.cfg.evaluate)
    else:
        metrics["candidate"]["speed_note"] = "latency not measured (evaluate.latency=false)"
    _roofline_metrics(metrics, base, cand, cfg, ctx.threads)
    if cfg.lm_eval_tasks:
        described["lm_eval"] = lm_eval_scores(metrics, base, cand, tokens, data.items, cfg, ctx.scratch)
    metrics["candidate"]["layer_precision"] = candidate.layer_precision
    metrics["table"] = table_rows(metrics)
    return metrics, described


def _layers_in_words(nodes: list[str]) -> str:
    """['layers.0/attn/qkv_proj', 'layers.3/attn/qkv_proj', 'lm_head'] -> 'attn/qkv_proj 0,3; lm_head'."""
    import re

    by_kind: dict[str, list[str | None]] = {}
    for node in nodes:
        match = re.match(r".*layers\.(\d+|\*)/(.*)", node)
        kind, layer = (match.group(2), match.group(1)) if match else (node, None)
        by_kind.setdefault(kind, []).append(layer)
    parts = [kind if layers == [None] else f"{kind} {_ranges(layers)}" for kind, layers in by_kind.items()]
    return "; ".join(parts)


def _ranges(layers: list) -> str:
    """['0', '1', '2', '6'] -> '0-2,6'."""
    if not all(layer and layer.isdigit() for layer in layers):
        return ",".join(layer for layer in layers if layer)
    numbers = sorted(int(layer) for layer in layers)
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _perplexity_metrics(metrics, base, cand, tokens, items, cfg, described) -> None:
    ids = tokens("\n\n".join(items))[: cfg.perplexity_tokens]
    if len(ids) < cfg.perplexity_tokens:
        raise RecipeError(
            f"the evaluation text has {len(ids)} tokens, evaluate.task_params.perplexity_tokens "
            f"asks for {cfg.perplexity_tokens}: raise evaluate.data.count"
        )
    log.info("perplexity over %d held-out tokens (window %d)", len(ids), cfg.perplexity_window)
    b, c = perplexity(base, ids, cfg.perplexity_window), perplexity(cand, ids, cfg.perplexity_window)
    metrics["baseline"]["perplexity"], metrics["candidate"]["perplexity"] = b, c
    metrics["candidate"]["perplexity_increase_pct"] = (c / b - 1) * 100
    described["perplexity"] = {
        "tokens": len(ids),
        "window": cfg.perplexity_window,
        "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
    }


def _sample_metrics(metrics, base, cand, tokens, cfg) -> None:
    """One greedy continuation per side: a human-readable sanity check kept in the manifest."""
    prompt = tokens(cfg.sample_prompt)
    for side, runner in (("baseline", base), ("candidate", cand)):
        metrics[side]["sample"] = {
            "prompt": cfg.sample_prompt,
            "continuation": tokens.decode(greedy_ids(runner, prompt, 16)),
        }


def _speed_metrics(metrics, base, cand, tokens, items, requests, evaluate_cfg) -> None:
    """Generation speed at every request shape of the workload; the first shape's figures are also the
    run's headline ones (generation, decode_speedup, ttft_speedup: what a one-shape recipe reports)."""
    timed = timed_requests(
        {"baseline": base, "candidate": cand}, tokens, items, requests, evaluate_cfg.warmup, evaluate_cfg.repeats
    )
    for side in ("baseline", "candidate"):
        metrics[side]["requests"] = {}
    for request in requests:
        run = timed[request.key]
        b, c = run["runs"]["baseline"], run["runs"]["candidate"]
        metrics["baseline"]["requests"][request.key] = {"generation": b, "request_ms": request_ms(b, request.output)}
        metrics["candidate"]["requests"][request.key] = {
            "generation": c,
            "request_ms": request_ms(c, request.output),
            "decode_speedup": c["decode_tok_s"]["p50"] / b["decode_tok_s"]["p50"],
            "ttft_speedup": b["ttft_ms"]["p50"] / c["ttft_ms"]["p50"],
        }
    from optimize.evaluate.harness import timing_record

    metrics["candidate"]["timing"] = timing_record(timed)
    first = metrics["candidate"]["requests"][requests[0].key]
    metrics["baseline"]["generation"] = metrics["baseline"]["requests"][requests[0].key]["generation"]
    metrics["candidate"]["generation"] = first["generation"]
    metrics["candidate"]["decode_speedup"] = first["decode_speedup"]
    metrics["candidate"]["ttft_speedup"] = first["ttft_speedup"]


def _roofline_metrics(metrics, base, cand, cfg, threads: int) -> None:
    """metrics[side]["roofline"]: weight and KV bytes read per decoded token, the memory read bandwidth
    measured now with the run's thread count, the bound it puts on decode tok/s, and the share of it
    the measured decode speed reaches (optimize/evaluate/roofline.py says what is counted)."""
    from engines.hardware import usable_cores
    from optimize.evaluate import roofline as rl
    from optimize.evaluate.benchmark import OtherCpuUse

    threads = threads or usable_cores()
    with OtherCpuUse() as others:
        bandwidth = rl.read_bandwidth(threads)
    bandwidth["other_cpu_share"] = others.share
    # Decode tokens 2..n (those decode tok/s is timed on) attend to prompt+1 .. prompt+n-1 cached tokens
    # (the first request shape's, whose decode speed is the headline one).
    first = metrics["candidate"].get("generation") or {}
    context = first.get("prompt_tokens", cfg.prompt_tokens) + first.get("new_tokens", cfg.new_tokens) // 2
    for side, runner in (("baseline", base), ("candidate", cand)):
        weight, kv = rl.runner_read_bytes(runner)
        tok_s = metrics[side].get("generation", {}).get("decode_tok_s", {}).get("p50")
        metrics[side]["roofline"] = {
            **rl.roofline(weight, kv, context, bandwidth["bandwidth_gb_s"], tok_s),
            "bandwidth": bandwidth,
        }
    log.info(
        "roofline: %.1f GB/s read (%d threads); bound %s / %s tok/s",
        bandwidth["bandwidth_gb_s"],
        threads,
        _fmt(metrics["baseline"]["roofline"]["bound_tok_s"], 1),
        _fmt(metrics["candidate"]["roofline"]["bound_tok_s"], 1),
    )


def _roofline_rows(b: dict, c: dict) -> list[list[str]]:
    rb, rc = b.get("roofline"), c.get("roofline")
    if not rb or not rc:
        return []

    def mb(r, key):
        return NOT_KNOWN if r.get(key) is None else f"{r[key] / 1e6:.1f}"

    def ratio(key, fmt):
        return fmt(rc[key] / rb[key]) if rb.get(key) and rc.get(key) is not None else ""

    rows = [
        [
            "weights read per token MB",
            mb(rb, "weight_bytes_per_token"),
            mb(rc, "weight_bytes_per_token"),
            ratio("weight_bytes_per_token", lambda x: f"{x:.2f}x"),
        ],
        [
            f"KV cache read per token MB ({rc['context_tokens']} tokens)",
            mb(rb, "kv_bytes_per_token"),
            mb(rc, "kv_bytes_per_token"),
            "",
        ],
        [
            "memory read bandwidth GB/s (measured)",
            _fmt(rb["bandwidth_gb_s"], 1),
            _fmt(rc["bandwidth_gb_s"], 1),
            f"{rc['bandwidth']['threads']} threads, others {rc['bandwidth']['other_cpu_share']:.0%} CPU",
        ],
        [
            "roofline bound decode tok/s",
            _fmt_known(rb["bound_tok_s"], 1),
            _fmt_known(rc["bound_tok_s"], 1),
            ratio("bound_tok_s", lambda x: f"{x:.2f}x"),
        ],
    ]
    if rb.get("share") is not None or rc.get("share") is not None:
        rows.append(["decode p50 share of bound", _pct(rb), _pct(rc), _limit(rc)])
    return rows


# At or above this share of the bandwidth bound, decode is taken to be limited by memory reads.
MEMORY_BOUND_SHARE = 0.5


def _limit(r: dict) -> str:
    """What the measured share says limits the candidate's decode."""
    if r.get("share") is None:
        return ""
    if r["share"] >= MEMORY_BOUND_SHARE:
        return "memory-bound: reading the weights and KV cache limits decode"
    return "not memory-bound: compute and per-token overhead limit decode"


def _fmt_known(value, digits=2) -> str:
    return NOT_KNOWN if value is None else f"{value:.{digits}f}"


def _pct(r: dict) -> str:
    if r.get("share") is not None:
        return f"{r['share']:.0%}"
    return NOT_KNOWN if r.get("bound_tok_s") is None else "-"


def _fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _shape_rows(base: dict, cand: dict, shapes: list[str]) -> list[list[str]]:
    """Every request shape of the workload: request time, then TTFT and decode p50 of the shapes
    after the first (whose rows come before, with their p95s)."""
    rows = []
    for i, shape in enumerate(shapes):
        b, c = base[shape], cand[shape]
        rows.append([f"request time p50 ms ({shape})", _fmt(b["request_ms"], 0), _fmt(c["request_ms"], 0), ""])
        rows[-1][3] = f"{b['request_ms'] / c['request_ms']:.2f}x"
        if i == 0:
            continue
        bg, cg = b["generation"], c["generation"]
        rows.append(
            [f"time to first token p50 ms ({shape})", _fmt(bg["ttft_ms"]["p50"]), _fmt(cg["ttft_ms"]["p50"]), ""]
        )
        rows[-1][3] = f"{c['ttft_speedup']:.2f}x"
        rows.append(
            [
                f"decode tok/s p50 ({shape})",
                _fmt(bg["decode_tok_s"]["p50"], 1),
                _fmt(cg["decode_tok_s"]["p50"], 1),
                f"{c['decode_speedup']:.2f}x",
            ]
        )
    return rows


def table_rows(metrics: dict) -> list[list[str]]:
    """Rows for the end-of-run table: [metric, baseline, candidate, ratio]."""
    b, c = metrics["baseline"], metrics["candidate"]
    rows = [
        [
            "perplexity (held-out)",
            _fmt(b["perplexity"], 3),
            _fmt(c["perplexity"], 3),
            f"{c['perplexity_increase_pct']:+.1f}%",
        ]
    ]
    for task, acc in c.get("lm_eval", {}).items():
        rows.append(
            [
                f"lm-eval {task} acc",
                _fmt(b["lm_eval"][task], 4),
                _fmt(acc, 4),
                f"{(acc - b['lm_eval'][task]) * 100:+.1f} pts",
            ]
        )
    if "generation" in c:
        bg, cg = b["generation"], c["generation"]
        shapes = list(c.get("requests") or {})
        at = f" ({shapes[0]})" if len(shapes) > 1 else ""  # several shapes: the rows say which
        for pct in ("p50", "p95"):
            rows.append(
                [
                    f"time to first token {pct} ms{at}",
                    _fmt(bg["ttft_ms"][pct]),
                    _fmt(cg["ttft_ms"][pct]),
                    f"{bg['ttft_ms'][pct] / cg['ttft_ms'][pct]:.2f}x" if pct == "p50" else "",
                ]
            )
        for pct in ("p50", "p95"):
            rows.append(
                [
                    f"decode tok/s {pct}{at}",
                    _fmt(bg["decode_tok_s"][pct], 1),
                    _fmt(cg["decode_tok_s"][pct], 1),
                    f"{cg['decode_tok_s'][pct] / bg['decode_tok_s'][pct]:.2f}x" if pct == "p50" else "",
                ]
            )
        if shapes[1:]:
            rows += _shape_rows(b["requests"], c["requests"], shapes)
    else:
        rows.append(["decode speed", "-", "-", c.get("speed_note", "not measured")])
    rows += _roofline_rows(b, c)
    for precision, info in c.get("layer_precision", {}).items():
        rows.append([f"weights kept at {precision}", "", f"{info['count']} nodes", _layers_in_words(info["nodes"])])
    rows.append(["greedy sample", repr(b["sample"]["continuation"][:40]), repr(c["sample"]["continuation"][:40]), ""])
    return rows
