"""Causal LMs: prompt limits, the generation service, tokens streamed back.

Two ways to generate, chosen by --max-num-seqs:

- Above 1 (the default): the engine's own scheduler, one engine for all requests, driven by one
  scheduling thread (serve/llm_batching.py). OpenVINO GenAI artifacts run its continuous-batching
  pipeline: requests join and leave the running batch at every step, the KV cache is paged and its
  size bounds admission. ONNX Runtime GenAI artifacts run its Engine, which on a CPU model batches
  statically: up to 4 requests start together and the next batch starts when that one has ended
  (engines.genai_runner.GenAIBatchEngine says why).
- 1: one generation at a time in a dedicated thread, through the runner the pipeline measured (both
  engines release the GIL while they decode).

Either way each token is handed to the event loop as it is produced, which is what makes
`stream: true` real streaming, and requests wait in a bounded queue: a full queue answers 429 at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from serve.errors import bad_request, busy, unavailable
from serve.protocol import GenerationRequest

if TYPE_CHECKING:
    from serve.config import ServeConfig

# Seeds each generation engine takes: its Python binding raises on anything else (a 500 otherwise).
# ONNX Runtime GenAI's random_seed is a signed 32-bit integer whose -1 means "seed from the clock",
# so negative seeds are refused there; OpenVINO GenAI's rng_seed is an unsigned 64-bit integer.
SEED_RANGES = {"onnxruntime-genai": (0, 2**31 - 1), "openvino-genai": (0, 2**64 - 1)}
# The batching engine of each format that has one: module, loader (root, engine block, settings, threads)
# and its extra arguments (OpenVINO's threads must not spin: they would take the event loop's cores).
BATCH_ENGINES: dict[str, tuple[str, str, dict]] = {
    "openvino-genai": ("engines.openvino_genai_batch", "load_ov_genai_batch_engine", {"spinning": False}),
    "onnxruntime-genai": ("engines.genai_runner", "load_genai_batch_engine", {}),
}


class GenerativeModel:
    task = "causal_lm"
    ANSWERS = frozenset({"completions"})
    USE = "a causal LM: use /v1/completions or /v1/chat/completions"

    @classmethod
    def load(cls, root: Path, engine: dict, config: ServeConfig) -> GenerativeModel:
        return cls(
            root, engine, config.ort_threads(), config.max_prompt_tokens, config.max_tokens, batch_settings(config)
        )

    def __init__(
        self,
        root: Path,
        engine: dict,
        threads: int = 0,
        max_prompt_tokens: int = 0,
        max_tokens: int = 512,
        batch=None,  # engines.openvino_genai_batch.BatchSettings, or None for one at a time
    ):
        from engines import load_engine

        self.format = str(engine.get("format"))
        self.seed_range = SEED_RANGES.get(self.format, SEED_RANGES["onnxruntime-genai"])
        self.batching = self.format in BATCH_ENGINES and batch is not None and batch.max_num_seqs > 1
        if self.batching:
            # Only the batching engine is loaded (for OpenVINO GenAI: not LLMPipeline too).
            self.runner: Any = load_batch_engine(self.format, root, engine, batch, threads)
        else:
            self.runner = cast(Any, load_engine(root, engine, threads=threads))  # a GenAIRunner or OVGenAIRunner
        self.context_length = self.runner.context_length
        self.max_prompt_tokens = min(max_prompt_tokens or self.context_length - 1, self.context_length - 1)
        self.max_tokens = max_tokens
        # Tokens the KV cache holds at most (continuous batching): a request must fit it on its own.
        self.cache_tokens = self.runner.num_blocks * self.runner.block_tokens if self.batching else 0

    def describe(self) -> str:
        """How generations are run, for the startup line."""
        r = self.runner
        if self.batching and self.format == "onnxruntime-genai":
            return describe_genai_static(r)
        if self.batching:
            return (
                f"continuous batching in OpenVINO GenAI's scheduler: up to {r.settings.max_num_seqs} sequences, "
                f"KV cache {r.kv_cache_bytes / 2**20:.1f} MiB ({r.num_blocks} blocks of {r.block_tokens} tokens), "
                f"{r.settings.max_batched_tokens} tokens per step, prefix caching "
                f"{'on' if r.settings.prefix_caching else 'off'}"
            )
        return "one generation at a time (--max-num-seqs 1)"

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            ids = self.runner.encode(self.runner.chat_prompt(request.messages))
        elif request.prompt is not None:
            ids = self.runner.encode(request.prompt)
        else:
            ids = list(request.prompt_ids or [])
            vocab = self.runner.vocab_size
            if vocab and not all(0 <= t < vocab for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens}", param="prompt"
            )
        return ids

    def token_budget(self, prompt_length: int, requested: int | None) -> int:
        """New tokens allowed: the request's max_tokens within the server cap and the context."""
        room = self.context_length - prompt_length
        if requested is not None and requested > self.max_tokens:
            raise bad_request(
                f"max_tokens {requested} exceeds this server's limit of {self.max_tokens}", param="max_tokens"
            )
        if requested is not None and requested > room:
            raise bad_request(
                f"prompt ({prompt_length} tokens) + max_tokens ({requested}) exceeds the "
                f"context length of {self.context_length}",
                param="max_tokens",
            )
        if self.cache_tokens and requested is not None:
            self.check_fits(prompt_length, requested)
        budget = min(requested or self.max_tokens, room)
        if self.cache_tokens and requested is None:  # no max_tokens asked: as many as the cache holds
            budget = min(budget, self.cache_tokens - 1 - prompt_length)
            self.check_fits(prompt_length, max(budget, 1))
        return budget

    def check_fits(self, prompt_length: int, new_tokens: int) -> None:
        """A request whose prompt and new tokens cannot fit the whole KV cache can never run: 400."""
        needed = self.runner.blocks_for(prompt_length + new_tokens)
        if needed <= self.runner.num_blocks:
            return
        asked = f"prompt ({prompt_length} tokens) + max_tokens ({new_tokens})"
        if self.runner.block_tokens == 1:  # a cache counted in tokens (ONNX Runtime GenAI's static batches)
            raise bad_request(
                f"{asked} need {needed} tokens of KV cache; this server's holds {self.cache_tokens} (--kv-cache-gb)",
                param="max_tokens",
            )
        raise bad_request(
            f"{asked} need {needed} KV-cache blocks of {self.runner.block_tokens} tokens; this server's KV cache "
            f"holds {self.runner.num_blocks} ({self.cache_tokens} tokens, --kv-cache-gb)",
            param="max_tokens",
        )

    def sampling(self, request: GenerationRequest, budget: int):
        """The engine's sampling settings; a seed outside the range the engine takes is a 400."""
        from engines.genai_runner import Sampling

        low, high = self.seed_range
        if request.seed is not None and not low <= request.seed <= high:
            raise bad_request(
                f"'seed' must be between {low} and {high} for this model, got {request.seed}", param="seed"
            )
        return Sampling(budget, request.temperature, request.top_p, request.seed)


def batch_settings(config: ServeConfig):
    """The continuous-batching engine's limits from the server settings."""
    from engines.openvino_genai_batch import BatchSettings

    return BatchSettings(
        max_num_seqs=config.max_num_seqs,
        kv_cache_bytes=int(config.kv_cache_gb * 2**30),
        max_batched_tokens=config.max_batched_tokens,
        prefix_caching=config.prefix_caching,
    )


def load_batch_engine(fmt: str, root: Path, engine: dict, batch, threads: int):
    import importlib

    module, loader, extra = BATCH_ENGINES[fmt]
    return getattr(importlib.import_module(module), loader)(root, engine, batch, threads=threads, **extra)


def describe_genai_static(r) -> str:
    """The startup line of ONNX Runtime GenAI's Engine: what it batches, and each setting it cannot honour."""
    asked = r.asked.max_num_seqs
    clamp = (
        f" (--max-num-seqs {asked} asked: its static batches hold {r.settings.max_num_seqs})"
        if asked > r.settings.max_num_seqs
        else ""
    )
    return (
        f"static batching in ONNX Runtime GenAI's Engine, not continuous: up to {r.settings.max_num_seqs} sequences "
        f"start together{clamp} and the next batch starts when the longest has ended, so a request that arrives "
        f"meanwhile waits and a cancelled sequence is computed until its batch ends; KV cache "
        f"{r.kv_cache_bytes / 2**20:.1f} MiB ({r.num_blocks} tokens; a batch takes its size x its longest prompt + "
        f"max_tokens); --max-batched-tokens not applied (a batch's prompts are prefilled whole); prefix caching "
        f"off; a seeded sampled request runs alone (the static Engine takes no seed per request). ONNX Runtime "
        f"GenAI batches continuously (paged KV cache, prefix caching) only with a "
        f"PagedAttention model, which its builder makes for CUDA and WebGPU, not for CPU"
    )


@dataclass
class Generation:
    """One request's stream of events: ("token", text), then ("end", reason) or ("error", exc)."""

    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    first_at: float = 0.0  # perf_counter() of the first token
    last_at: float = 0.0  # ... and of the latest one


def observe_token(metrics, generation: Generation) -> None:
    """Count one token of a stream: time to first token, then the gap since the previous one."""
    now = time.perf_counter()
    generation.tokens += 1
    if metrics:
        metrics.generation_tokens.inc()
    if generation.tokens == 1:
        generation.first_at = now
        if metrics:
            metrics.ttft.observe(now - generation.started)
    elif metrics:
        metrics.itl.observe(now - generation.last_at)
    generation.last_at = now


def observe_end(metrics, generation: Generation) -> None:
    """A generation that ran to its end (not one cancelled or failed)."""
    if not metrics or not generation.tokens:
        return
    now = time.perf_counter()
    metrics.generated_tokens.inc(generation.tokens)
    metrics.tokens_per_s.observe(generation.tokens / max(now - generation.started, 1e-9))
    metrics.e2e.observe(now - generation.started)
    if generation.tokens > 1:
        metrics.tpot.observe((generation.last_at - generation.first_at) / (generation.tokens - 1))


class GenerationService:
    def __init__(self, model: GenerativeModel, max_queue: int, metrics=None):
        self.model = model
        self.max_queue = max_queue
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.pending = 0  # queued + running
        self.closing = False

    def submit(self, prompt_ids: list[int], sampling) -> Generation:
        if self.closing:
            raise unavailable("the model is not accepting requests")
        if self.pending >= self.max_queue:
            raise busy()
        loop = asyncio.get_running_loop()
        generation = Generation(asyncio.Queue())
        self.pending += 1
        self.observe_queue()
        future = loop.run_in_executor(self.executor, self.run, loop, generation, prompt_ids, sampling)
        future.add_done_callback(lambda _: self.finished())
        return generation

    def finished(self) -> None:
        self.pending -= 1
        self.observe_queue()

    def observe_queue(self) -> None:
        if self.metrics:
            waiting = max(self.pending - 1, 0)
            self.metrics.queue_depth.set(waiting)
            self.metrics.waiting.set(waiting)
            self.metrics.running.set(min(self.pending, 1))

    def run(self, loop, generation: Generation, prompt_ids: list[int], sampling) -> None:
        """In the worker thread: decode and post every token to the request's event queue."""
        post = lambda *event: loop.call_soon_threadsafe(generation.events.put_nowait, event)  # noqa: E731
        if generation.cancel.is_set():  # timed out or disconnected while queued
            return post("end", "cancelled")
        if self.metrics:
            self.metrics.request_queue_time.observe(time.perf_counter() - generation.started)
        try:
            for _, piece in self.model.runner.generate(prompt_ids, sampling, generation.cancel.is_set):
                observe_token(self.metrics, generation)
                post("token", piece)
        except Exception as exc:
            return post("error", exc)
        observe_end(self.metrics, generation)
        post("end", "length" if generation.tokens >= sampling.max_new_tokens else "stop")

    async def stop(self) -> None:
        """Drain: let queued and running generations finish, then release the thread."""
        self.closing = True
        while self.pending:
            await asyncio.sleep(0.05)
        self.executor.shutdown(wait=True)


class StopMatcher:
    """Cuts the output at the first stop string, holding back text that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.buffer = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Text that is safe to emit now (never part of a stop string)."""
        if not self.stops:
            return piece
        self.buffer += piece
        cut = min((i for i in (self.buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.buffer = self.buffer[:cut], ""
            return out
        keep = self.partial_suffix()
        out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return out

    def partial_suffix(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop string."""
        for size in range(min(len(self.buffer), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.buffer[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
