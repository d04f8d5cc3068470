"""Greedy generation measured and scored: the artifact's tokenizer, perplexity over token windows,
time to first token and decode tokens/s (p50/p95 over interleaved runs), and the prompts of a
workload's request shapes cut from the evaluation text.

Used by the causal-LM task's evaluation (optimize/tasks/causal_lm.py), the engine race's LM scoring
and the stages that need the evaluation's token ids.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Mapping

import numpy as np

from engines.runners import TimedGeneration
from optimize.errors import RecipeError

log = logging.getLogger(__name__)


class Tokens:
    """The artifact's own tokenizer (tokenizers library), without truncation or padding."""

    def __init__(self, ctx):
        if ctx.encoder is None:
            raise RecipeError("model.task=causal_lm needs a tokenizer in the model folder")
        import copy

        self.tokenizer = copy.deepcopy(ctx.encoder.tokenizer)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.folder = getattr(ctx.encoder, "folder", None)  # the shipped tokenizer's: its chat template
        self._chat_tokenizer = None

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def chat(self, messages: list[dict]) -> list[int]:
        """A conversation as the model's chat template renders it for a reply, in token ids (the
        template's special tokens included): what a chat client's request becomes."""
        if self._chat_tokenizer is None:
            from transformers import AutoTokenizer

            found = self.folder is not None and AutoTokenizer.from_pretrained(str(self.folder))
            if not found or not getattr(found, "chat_template", None):
                raise RecipeError(
                    "workload.requests: a grounded shape needs a chat template, and the model's tokenizer "
                    f"({self.folder}) has none"
                )
            self._chat_tokenizer = found
        text = self._chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self(str(text))


def ids_sha256(ids: list[int]) -> str:
    """The held-out token ids' identity (the manifest's evaluation.perplexity.sha256)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


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


# Timed runs a time budget leaves at the least: a median needs two.
MIN_TIMED_RUNS = 2
# Seconds of timed runs at each request shape in the pipeline's timing (timed_requests); past them the
# medians are of the runs made. SmolLM2's longest shape takes a few seconds a run, so it is timed as
# before; a random bf16 Llama of Llama-3.2-1B's shape took 46 s a 1,024-token request on PyTorch (2-core
# Zen 4), and five runs of each shape were minutes of a run for figures no more certain than two.
TIMING_BUDGET_S = 60.0


def speed(
    runners: Mapping[str, TimedGeneration],
    prompts: list[list[int]],
    new_tokens: int,
    warmup: int,
    runs: int,
    budget_s: float | None = None,
) -> dict:
    """TTFT and decode tokens/s per runner over `runs` timed generations (after `warmup`), interleaved
    and in alternating order, each after an untimed settling generation (SETTLE_TOKENS). Decode speed
    of a run = (n - 1) / (time of token n - time of token 1). The p95 of tokens/s is the slow tail:
    the 5th percentile of per-run tokens/s. With `budget_s`, no timed run starts once the timed runs
    have taken that long (MIN_TIMED_RUNS at the least); `runs` in the result is how many ran."""
    samples: dict[str, dict[str, list[float]]] = {name: {"ttft_ms": [], "tok_s": []} for name in runners}
    names = list(runners)
    timed_from = 0.0
    for i in range(warmup + runs):
        if i == warmup:
            timed_from = time.perf_counter()
        spent = time.perf_counter() - timed_from
        if budget_s is not None and i - warmup >= MIN_TIMED_RUNS and spent > budget_s:
            log.info("generation timing: %d runs of %d in its %.0f s budget", i - warmup, runs, budget_s)
            break
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
            "runs": len(s["tok_s"]),
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


# Grounded requests a shape holds at most: one per client at the levels the race times.
GROUNDED_PROMPTS = 16


def shape_prompts(tokens: Tokens, items: list[str], request) -> list[list[int]]:
    """The prompts of a workload request shape (optimize/workload.py's RequestPoint): cut from the
    evaluation text, or for a grounded shape chat requests about its paragraphs of about `prompt`
    tokens, rendered by the model's chat template."""
    if request.kind != "grounded":
        return prompts_of(tokens, items, request.prompt)
    from optimize.evaluate.grounded import grounded_requests

    longest = sum(len(tokens(item)) >= request.prompt for item in items)
    if not longest:
        raise RecipeError(
            f"workload.requests: no evaluation item has the {request.prompt} tokens a {request.key} "
            "paragraph needs: lower its prompt or give longer evaluation text"
        )
    count = min(GROUNDED_PROMPTS, longest)
    return [tokens.chat(m) for m in grounded_requests(count, request.prompt, tokens, tokens.decode, texts=items)]


def timed_requests(
    runners: Mapping[str, TimedGeneration],
    tokens: Tokens,
    items: list[str],
    requests,
    warmup: int,
    runs: int,
    retimes: int,
    budget_s: float | None = TIMING_BUDGET_S,
) -> dict:
    """{shape key: the quietest speed() run of that request shape (timed again, up to `retimes` more
    times, while other processes took more than benchmark.RETIME_SHARE of the CPUs), with
    other_cpu_share, retimes}. `budget_s`: speed()'s, for each shape's timed runs."""
    from optimize.evaluate.benchmark import OtherCpuUse, quietest

    def once(prompts: list[list[int]], output: int) -> dict:
        with OtherCpuUse() as others:
            result = speed(runners, prompts, output, warmup, runs, budget_s)
        return {"runs": result, "other_cpu_share": others.share}

    timed = {}
    for request in requests:
        prompts = shape_prompts(tokens, items, request)
        log.info("greedy generation %s: %d runs per side", request.key, runs)
        timed[request.key] = quietest(lambda: once(prompts, request.output), retimes)  # noqa: B023
    return timed


def request_ms(result: dict, new_tokens: int) -> float:
    """Milliseconds to answer: first token, then the rest at the median decode speed."""
    return result["ttft_ms"]["p50"] + (new_tokens - 1) / result["decode_tok_s"]["p50"] * 1000
