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
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from optimize import tasks
from optimize.errors import RecipeError

log = logging.getLogger(__name__)
LOCAL_TASK = "cpython_next_sentence"


@dataclass
class LLMEvalConfig:
    """evaluate.task_params for model.task=causal_lm. Example:

        evaluate:
          task_params: {perplexity_tokens: 2048, new_tokens: 64, lm_eval_tasks: [cpython_next_sentence]}
    """

    perplexity_tokens: int = 2048  # held-out tokens scored (FIELD-NOTES figures use 2,048)
    perplexity_window: int = 512  # tokens per forward pass; each window starts without context
    prompt_tokens: int = 64  # prompt length for the speed runs
    new_tokens: int = 64  # tokens generated per speed run (EOS cannot stop a run early)
    lm_eval_tasks: List[str] = field(default_factory=lambda: [LOCAL_TASK])
    lm_eval_limit: Optional[int] = 100  # questions per task (null: all)
    sample_prompt: str = "The capital of Italy is"  # greedy continuation recorded for both sides

    def validate(self):
        if min(self.perplexity_tokens, self.perplexity_window, self.prompt_tokens) < 2 or self.new_tokens < 2:
            raise RecipeError("evaluate.task_params: token counts must be at least 2")


def eval_config(ctx) -> LLMEvalConfig:
    from omegaconf import OmegaConf

    from optimize.registry import Method, build_config

    params = OmegaConf.to_container(ctx.cfg.evaluate.get("task_params") or {}, resolve=True)
    method = Method("evaluate", "causal_lm", LLMEvalConfig, fn=None)
    try:
        return build_config(method, params)
    except RecipeError as exc:  # the registry names the key as evaluate.params.*; say task_params
        raise RecipeError(str(exc).replace("evaluate.params.", "evaluate.task_params.")) from None


# ---------------------------------------------------------------- source: GGUF -> cached HF folder

def cache_root() -> Path:
    return Path(os.environ.get("OPTIMIZE_CACHE") or Path.home() / ".cache" / "optimize").expanduser()


def hf_folder(source) -> Path:
    """A Hugging Face folder (config + safetensors + tokenizer) for builders that read one.

    A folder source is used as it is. A GGUF source was dequantized to FP32 on load; the module is
    saved once under the cache, keyed by the GGUF file's sha256, so later runs reuse it."""
    location = Path(source.location)
    if not source.gguf_file:
        if not (location / "config.json").is_file():
            raise RecipeError(f"model.source={source.location}: the engine needs a local model folder")
        return location
    from engines.artifact import sha256_file

    folder = cache_root() / "gguf" / sha256_file(location / source.gguf_file)[:24]
    if not (folder / "model.safetensors").is_file():
        save_converted(source.module, location, source.gguf_file, folder)
    return folder


def save_converted(module, location: Path, gguf_file: str, folder: Path) -> None:
    """save_pretrained refuses GGUF-loaded models ("quantized with gguf"): rebuild the model from its
    config without quantization_config, load the dequantized weights, save that (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors under %s (once)", gguf_file, folder)
    config = module.config.__class__.from_dict(module.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=module.dtype)
    clean.load_state_dict(module.state_dict())
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(location), gguf_file=gguf_file).save_pretrained(str(tmp))
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


# ---------------------------------------------------------------- the PyTorch side

class TorchLM:
    """A Hugging Face causal LM behind the same scoring and timing calls as GenAIRunner."""

    input_names = ["input_ids"]
    output_names = ["logits"]

    def __init__(self, model, threads: int = 0):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()

    def logits(self, ids) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False)
        return out.logits[0].float().numpy()

    def log_likelihood(self, ids, start: int = 1) -> np.ndarray:
        from engines.genai_runner import token_logprobs

        return token_logprobs(self.logits(ids), ids)[start - 1:]

    def __call__(self, inputs: dict) -> dict:
        return {"logits": np.stack([self.logits(row) for row in inputs["input_ids"]])}

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        """Greedy `generate` with its KV cache for exactly new_tokens: perf_counter() at each new token."""
        import torch
        from transformers.generation.streamers import BaseStreamer

        class Stamps(BaseStreamer):
            def __init__(self):
                self.times, self.prompt_seen = [], False

            def put(self, value):
                if self.prompt_seen:  # the first put is the prompt itself
                    self.times.append(time.perf_counter())
                self.prompt_seen = True

            def end(self):
                pass

        stamps = Stamps()
        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, streamer=stamps,
                                pad_token_id=self.model.config.eos_token_id)
        return stamps.times

    def greedy(self, prompt_ids, new_tokens: int) -> list[int]:
        import torch

        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=self.model.config.eos_token_id)
        return out[0, ids.shape[1]:].tolist()


def greedy_ids(runner, prompt_ids, new_tokens: int) -> list[int]:
    """Greedy continuation token ids from either kind of runner."""
    if hasattr(runner, "greedy"):
        return runner.greedy(prompt_ids, new_tokens)
    from engines.genai_runner import Sampling

    return [t for t, _ in runner.generate([int(i) for i in prompt_ids], Sampling(max_new_tokens=new_tokens))]


# ---------------------------------------------------------------- the task

@dataclass
class CausalLM(tasks.Task):
    name: str = "causal_lm"
    input_names: tuple[str, ...] = ("input_ids",)
    output_names: tuple[str, ...] = ("logits",)
    dynamic_axes: dict = field(default_factory=lambda: {"input_ids": {0: "batch", 1: "sequence"}})

    def module(self, model, ctx):
        return _LogitsModule.wrap(model)

    def evaluate(self, baseline, candidate, ctx) -> tuple[dict, dict]:
        return evaluate_causal_lm(baseline, candidate, ctx)


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


tasks.register_task(CausalLM())


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
    logprobs = [runner.log_likelihood(ids[i:i + window]) for i in range(0, len(ids) - 1, window)
                if len(ids[i:i + window]) > 1]
    return float(np.exp(-np.concatenate(logprobs).mean()))


def percentiles(values) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}


def speed(runners: dict, prompts: list[list[int]], new_tokens: int, warmup: int, runs: int) -> dict:
    """TTFT and decode tokens/s per runner over `runs` timed generations (after `warmup`), interleaved
    and in alternating order. Decode speed of a run = (n - 1) / (time of token n - time of token 1).
    The p95 of tokens/s is the slow tail: the 5th percentile of per-run tokens/s."""
    samples = {name: {"ttft_ms": [], "tok_s": []} for name in runners}
    names = list(runners)
    for i in range(warmup + runs):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            stamps = runners[name].timed_stream(prompts[i % len(prompts)], new_tokens)
            if i >= warmup:
                samples[name]["ttft_ms"].append((stamps[0] - start) * 1000)
                samples[name]["tok_s"].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {name: {"ttft_ms": percentiles(s["ttft_ms"]),
                   "decode_tok_s": {"p50": float(np.percentile(s["tok_s"], 50)),
                                    "p95": float(np.percentile(s["tok_s"], 5))},
                   "runs": runs, "new_tokens": new_tokens, "prompt_tokens": len(prompts[0])}
            for name, s in samples.items()}


def evaluate_causal_lm(baseline, candidate, ctx) -> tuple[dict, dict]:
    cfg = eval_config(ctx)
    data = ctx.evaluation_data()
    tokens = Tokens(ctx)
    base = TorchLM(ctx.source.module, ctx.threads)
    cand = candidate.runner
    metrics = {"baseline": {"size_mb": baseline.size_bytes / 2**20},
               "candidate": {"size_mb": candidate.size_bytes / 2**20}}
    described = dict(data.describe())
    _perplexity_metrics(metrics, base, cand, tokens, data.items, cfg, described)
    _sample_metrics(metrics, base, cand, tokens, cfg)
    if ctx.cfg.evaluate.latency:
        _speed_metrics(metrics, base, cand, tokens, data.items, cfg, ctx.cfg.evaluate)
    else:
        metrics["candidate"]["speed_note"] = "latency not measured (evaluate.latency=false)"
    if cfg.lm_eval_tasks:
        described["lm_eval"] = _lm_eval_metrics(metrics, base, cand, tokens, data.items, cfg, ctx.scratch)
    metrics["candidate"]["layer_precision"] = layer_precision(ctx)
    metrics["table"] = table_rows(metrics)
    return metrics, described


def layer_precision(ctx) -> dict:
    """{precision: {count, layers}} as the engine or quantize stage recorded it (engine first)."""
    stages = ctx.records.get("stages", {})
    for stage in ("engine", "quantize"):
        found = (stages.get(stage) or {}).get("layer_precision")
        if found:
            return found
    return {}


def _layers_in_words(nodes: list[str]) -> str:
    """['layers.0/attn/qkv_proj', 'layers.3/attn/qkv_proj', 'lm_head'] -> 'attn/qkv_proj 0,3; lm_head'."""
    import re

    by_kind: dict[str, list[str]] = {}
    for node in nodes:
        match = re.match(r".*layers\.(\d+|\*)/(.*)", node)
        kind, layer = (match.group(2), match.group(1)) if match else (node, None)
        by_kind.setdefault(kind, []).append(layer)
    parts = [kind if layers == [None] else f"{kind} {_ranges(layers)}" for kind, layers in by_kind.items()]
    return "; ".join(parts)


def _ranges(layers: list) -> str:
    """['0', '1', '2', '6'] -> '0-2,6'."""
    if not all(l and l.isdigit() for l in layers):
        return ",".join(l for l in layers if l)
    numbers, spans = sorted(int(l) for l in layers), []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _perplexity_metrics(metrics, base, cand, tokens, items, cfg, described) -> None:
    ids = tokens("\n\n".join(items))[: cfg.perplexity_tokens]
    if len(ids) < cfg.perplexity_tokens:
        raise RecipeError(f"the evaluation text has {len(ids)} tokens, evaluate.task_params.perplexity_tokens "
                          f"asks for {cfg.perplexity_tokens}: raise evaluate.data.count")
    log.info("perplexity over %d held-out tokens (window %d)", len(ids), cfg.perplexity_window)
    b, c = perplexity(base, ids, cfg.perplexity_window), perplexity(cand, ids, cfg.perplexity_window)
    metrics["baseline"]["perplexity"], metrics["candidate"]["perplexity"] = b, c
    metrics["candidate"]["perplexity_increase_pct"] = (c / b - 1) * 100
    described["perplexity"] = {"tokens": len(ids), "window": cfg.perplexity_window,
                               "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


def _sample_metrics(metrics, base, cand, tokens, cfg) -> None:
    """One greedy continuation per side: a human-readable sanity check kept in the manifest."""
    prompt = tokens(cfg.sample_prompt)
    for side, runner in (("baseline", base), ("candidate", cand)):
        metrics[side]["sample"] = {"prompt": cfg.sample_prompt,
                                   "continuation": tokens.decode(greedy_ids(runner, prompt, 16))}


def _speed_metrics(metrics, base, cand, tokens, items, cfg, evaluate_cfg) -> None:
    prompts = [ids[: cfg.prompt_tokens] for ids in map(tokens, items) if len(ids) >= cfg.prompt_tokens]
    if not prompts:
        raise RecipeError(f"no evaluation item has {cfg.prompt_tokens} tokens for a speed prompt")
    log.info("greedy generation: %d runs of %d tokens per side", evaluate_cfg.repeats, cfg.new_tokens)
    from optimize.benchmark import OtherCpuUse

    with OtherCpuUse() as others:
        result = speed({"baseline": base, "candidate": cand}, prompts, cfg.new_tokens, evaluate_cfg.warmup,
                       evaluate_cfg.repeats)
    metrics["candidate"]["timing"] = {"other_cpu_share": others.share}
    metrics["baseline"]["generation"], metrics["candidate"]["generation"] = result["baseline"], result["candidate"]
    b, c = result["baseline"], result["candidate"]
    metrics["candidate"]["decode_speedup"] = c["decode_tok_s"]["p50"] / b["decode_tok_s"]["p50"]
    metrics["candidate"]["ttft_speedup"] = b["ttft_ms"]["p50"] / c["ttft_ms"]["p50"]


def _fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(metrics: dict) -> list[list[str]]:
    """Rows for the end-of-run table: [metric, baseline, candidate, ratio]."""
    b, c = metrics["baseline"], metrics["candidate"]
    rows = [["perplexity (held-out)", _fmt(b["perplexity"], 3), _fmt(c["perplexity"], 3),
             f"{c['perplexity_increase_pct']:+.1f}%"]]
    for task, acc in c.get("lm_eval", {}).items():
        rows.append([f"lm-eval {task} acc", _fmt(b["lm_eval"][task], 4), _fmt(acc, 4),
                     f"{(acc - b['lm_eval'][task]) * 100:+.1f} pts"])
    if "generation" in c:
        bg, cg = b["generation"], c["generation"]
        for pct in ("p50", "p95"):
            rows.append([f"time to first token {pct} ms", _fmt(bg["ttft_ms"][pct]), _fmt(cg["ttft_ms"][pct]),
                         f"{bg['ttft_ms'][pct] / cg['ttft_ms'][pct]:.2f}x" if pct == "p50" else ""])
        for pct in ("p50", "p95"):
            rows.append([f"decode tok/s {pct}", _fmt(bg["decode_tok_s"][pct], 1), _fmt(cg["decode_tok_s"][pct], 1),
                         f"{cg['decode_tok_s'][pct] / bg['decode_tok_s'][pct]:.2f}x" if pct == "p50" else ""])
    else:
        rows.append(["decode speed", "-", "-", c.get("speed_note", "not measured")])
    for precision, info in c.get("layer_precision", {}).items():
        rows.append([f"weights kept at {precision}", "", f"{info['count']} nodes", _layers_in_words(info["nodes"])])
    rows.append(["greedy sample", repr(b["sample"]["continuation"][:40]), repr(c["sample"]["continuation"][:40]), ""])
    return rows


# ---------------------------------------------------------------- lm-eval

def next_sentence_items(paragraphs: list[str], count: int, choices: int = 4, seed: int = 0) -> list[dict]:
    """Multiple choice made from held-out prose: given a paragraph's first sentence, pick the sentence
    that follows it; the wrong choices are second sentences of other paragraphs."""
    import random

    pairs = []
    for text in paragraphs:
        sentences = [s.strip() + "." for s in " ".join(text.split()).split(". ") if len(s.strip()) > 20]
        if len(sentences) >= 2:
            pairs.append((sentences[0], sentences[1]))
    rng = random.Random(seed)
    items = []
    for i, (context, answer) in enumerate(pairs[:count]):
        others = [p[1] for j, p in enumerate(pairs) if j != i and p[1] != answer]
        options = rng.sample(others, min(choices - 1, len(others))) + [answer]
        rng.shuffle(options)
        items.append({"context": context, "choices": options, "label": options.index(answer)})
    return items


def write_local_task(items: list[dict], folder: Path) -> Path:
    """A YAML task over a local jsonl file, loadable with TaskManager(include_path=folder), offline."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{LOCAL_TASK}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / f"{LOCAL_TASK}.yaml").write_text(
        f"task: {LOCAL_TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return data


def lm_adapter(runner, tokens: Tokens):
    """An lm-eval LM over any runner with log_likelihood (the same scoring perplexity uses)."""
    from lm_eval.api.model import LM

    class Adapter(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            results = []
            for request in requests:
                context, continuation = request.args
                head, tail = tokens(context), tokens(continuation)
                logprobs = runner.log_likelihood(head + tail, start=len(head))
                results.append((float(logprobs.sum()), False))  # greediness is not used by acc
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return [(float(runner.log_likelihood(tokens(r.args[0])).sum()),) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False):
            outputs = []
            for request in requests:
                context, options = request.args
                text = tokens.decode(greedy_ids(runner, tokens(context), int(options.get("max_gen_toks", 64))))
                for stop in options.get("until") or []:
                    text = text.split(stop)[0]
                outputs.append(text)
            return outputs

    return Adapter()


def _lm_eval_metrics(metrics, base, cand, tokens, paragraphs, cfg, scratch: Path) -> dict:
    """Accuracy per task for both sides, and the candidate's largest drop in points."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise RecipeError("evaluate.task_params.lm_eval_tasks needs lm-eval: pip install lm-eval "
                          "(or set evaluate.task_params.lm_eval_tasks=[])") from None
    if os.environ.get("HF_HUB_OFFLINE") == "1":  # the local task must not wait on an unreachable hub
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    items = next_sentence_items(paragraphs, cfg.lm_eval_limit or len(paragraphs))
    data = write_local_task(items, scratch / "lm_eval")
    manager = TaskManager(include_path=str(data.parent))
    scores = {}
    for side, runner in (("baseline", base), ("candidate", cand)):
        log.info("lm-eval %s: %s", side, ", ".join(cfg.lm_eval_tasks))
        try:
            out = lm_eval.simple_evaluate(model=lm_adapter(runner, tokens), tasks=list(cfg.lm_eval_tasks),
                                          task_manager=manager, limit=cfg.lm_eval_limit, num_fewshot=0,
                                          bootstrap_iters=0, log_samples=False, verbosity="ERROR")
        except Exception as exc:  # a standard task whose dataset cannot be fetched offline, a typo, ...
            raise RecipeError(f"lm-eval could not run {cfg.lm_eval_tasks}: {str(exc).splitlines()[0][:200]}") from None
        scores[side] = {task: float(result["acc,none"]) for task, result in out["results"].items()
                        if "acc,none" in result}
        metrics[side]["lm_eval"] = scores[side]
    metrics["candidate"]["lm_eval_drop_pts"] = max(
        (scores["baseline"][t] - scores["candidate"][t]) * 100 for t in scores["candidate"])
    return {"tasks": list(cfg.lm_eval_tasks), "limit": cfg.lm_eval_limit, "local_items": len(items),
            "local_sha256": hashlib.sha256(data.read_bytes()).hexdigest()}
