"""One generation at a time: the bounded queue in front of a Generator (engines/generation.py), its
tokens handed to the event loop as they are produced, and the per-token metrics both services count.

With --max-num-seqs 1, or a format whose row says batching="none", generations run one after another
in a dedicated thread, through the runner the pipeline measured (the GenAI engines release the GIL
while they decode). Each request's events (`Generation`) are what the routes read, whichever service
produced them (serve/llm/batching.py posts the same ones).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engines.generation import Generator, Sampling
from serve.errors import busy, unavailable


@dataclass
class Generation:
    """One request's stream of events: ("token", text) (("token", text, entry) where the request asked
    for logprobs: serve/llm/logprobs.py's entry), then ("end", reason) or ("error", exc)."""

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
    def __init__(self, generator: Generator, max_queue: int, metrics=None):
        self.generator = generator
        self.max_queue = max_queue
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.pending = 0  # queued + running
        self.closing = False

    def submit(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
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

    def run(self, loop, generation: Generation, prompt_ids: list[int], sampling: Sampling) -> None:
        """In the worker thread: decode and post every token to the request's event queue."""
        post = lambda *event: loop.call_soon_threadsafe(generation.events.put_nowait, event)  # noqa: E731
        if generation.cancel.is_set():  # timed out or disconnected while queued
            return post("end", "cancelled")
        if self.metrics:
            self.metrics.request_queue_time.observe(time.perf_counter() - generation.started)
        try:
            if sampling.logprobs:
                self.generate_scored(generation, prompt_ids, sampling, post)
            else:
                for _, piece in self.generator.generate(prompt_ids, sampling, generation.cancel.is_set):
                    observe_token(self.metrics, generation)
                    post("token", piece)
        except Exception as exc:
            return post("error", exc)
        observe_end(self.metrics, generation)
        post("end", "length" if generation.tokens >= sampling.max_new_tokens else "stop")

    def generate_scored(self, generation: Generation, prompt_ids: list[int], sampling: Sampling, post) -> None:
        """As run() does, with each token's logprob entry beside its text."""
        from serve.llm.logprobs import token_entry

        scored: list = []  # the engine hands each token's TokenLogprob before it yields the token
        for _, piece in self.generator.generate(prompt_ids, sampling, generation.cancel.is_set, scored.append):
            observe_token(self.metrics, generation)
            post("token", piece, token_entry(self.generator, scored.pop()))

    async def stop(self) -> None:
        """Drain: let queued and running generations finish, then release the thread."""
        self.closing = True
        while self.pending:
            await asyncio.sleep(0.05)
        self.executor.shutdown(wait=True)
