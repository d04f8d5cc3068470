"""Causal LMs: prompt limits, one generation at a time in a worker thread, tokens streamed back.

Generation runs in one dedicated thread (ONNX Runtime GenAI releases the GIL while it decodes);
each token is handed to the event loop as it is produced, which is what makes `stream: true`
real streaming. Requests wait in a bounded queue: a full queue answers 429 at once.

Batching several generations at once (continuous batching) is not done: on a 2-core CPU one
decode already uses the cores, and it keeps this module small. The queue bound and the per-request
limits still hold.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from serve.errors import bad_request, busy, unavailable
from serve.protocol import GenerationRequest

# Seeds each generation engine takes: its Python binding raises on anything else (a 500 otherwise).
# ONNX Runtime GenAI's random_seed is a signed 32-bit integer whose -1 means "seed from the clock",
# so negative seeds are refused there; OpenVINO GenAI's rng_seed is an unsigned 64-bit integer.
SEED_RANGES = {"onnxruntime-genai": (0, 2**31 - 1), "openvino-genai": (0, 2**64 - 1)}


class GenerativeModel:
    task = "causal_lm"

    def __init__(self, root: Path, engine: dict, threads: int = 0, max_prompt_tokens: int = 0, max_tokens: int = 512):
        from engines import load_engine

        self.seed_range = SEED_RANGES.get(str(engine.get("format")), SEED_RANGES["onnxruntime-genai"])
        self.runner: Any = cast(Any, load_engine(root, engine, threads=threads))  # a GenAIRunner
        self.context_length = self.runner.context_length
        self.max_prompt_tokens = min(max_prompt_tokens or self.context_length - 1, self.context_length - 1)
        self.max_tokens = max_tokens

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
        return min(requested or self.max_tokens, room)

    def sampling(self, request: GenerationRequest, budget: int):
        """The engine's sampling settings; a seed outside the range the engine takes is a 400."""
        from engines.genai_runner import Sampling

        low, high = self.seed_range
        if request.seed is not None and not low <= request.seed <= high:
            raise bad_request(
                f"'seed' must be between {low} and {high} for this model, got {request.seed}", param="seed"
            )
        return Sampling(budget, request.temperature, request.top_p, request.seed)


@dataclass
class Generation:
    """One request's stream of events: ("token", text), then ("end", reason) or ("error", exc)."""

    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0


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
            self.metrics.queue_depth.set(max(self.pending - 1, 0))

    def run(self, loop, generation: Generation, prompt_ids: list[int], sampling) -> None:
        """In the worker thread: decode and post every token to the request's event queue."""
        post = lambda *event: loop.call_soon_threadsafe(generation.events.put_nowait, event)  # noqa: E731
        if generation.cancel.is_set():  # timed out or disconnected while queued
            return post("end", "cancelled")
        try:
            for _, piece in self.model.runner.generate(prompt_ids, sampling, generation.cancel.is_set):
                generation.tokens += 1
                if generation.tokens == 1 and self.metrics:
                    self.metrics.ttft.observe(time.perf_counter() - generation.started)
                post("token", piece)
        except Exception as exc:
            return post("error", exc)
        self.observe_speed(generation)
        post("end", "length" if generation.tokens >= sampling.max_new_tokens else "stop")

    def observe_speed(self, generation: Generation) -> None:
        if self.metrics and generation.tokens:
            self.metrics.generated_tokens.inc(generation.tokens)
            self.metrics.tokens_per_s.observe(generation.tokens / max(time.perf_counter() - generation.started, 1e-9))

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
