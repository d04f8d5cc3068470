"""One generation at a time: the bounded queue in front of a Generator (engines/generation.py), its
tokens handed to the event loop as they are produced.

With --max-num-seqs 1, or a format whose row says batching="none", generations run one after another
in a dedicated thread, through the runner the pipeline measured (the GenAI engines release the GIL
while they decode). Each request's events (serve/llm/events.py) are what the routes read, whichever
service produced them (serve/llm/batching.py posts the same ones).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from engines.generation import Generator, Sampling
from serve.errors import busy, unavailable
from serve.llm.events import End, Event, Failed, Generation, Token, observe_end, observe_token


class GenerationService:
    """A GenerationQueue (serve/llm/events.py) of one generation at a time."""

    def __init__(self, generator: Generator, max_queue: int, metrics=None):
        self.generator = generator
        self.max_queue = max_queue
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.pending = 0  # queued + running
        self.arriving = 0  # counted by the routes; generations do not wait for company here
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

        def post(event: Event) -> None:
            loop.call_soon_threadsafe(generation.events.put_nowait, event)

        if generation.cancel.is_set():  # timed out or disconnected while queued
            return post(End("cancelled"))
        if self.metrics:
            self.metrics.request_queue_time.observe(time.perf_counter() - generation.started)
        try:
            if sampling.logprobs:
                self.generate_scored(generation, prompt_ids, sampling, post)
            else:
                for _, piece in self.generator.generate(prompt_ids, sampling, generation.cancel.is_set):
                    observe_token(self.metrics, generation)
                    post(Token(piece))
        except Exception as exc:
            return post(Failed(exc))
        observe_end(self.metrics, generation)
        post(End("length" if generation.tokens >= sampling.max_new_tokens else "stop"))

    def generate_scored(
        self, generation: Generation, prompt_ids: list[int], sampling: Sampling, post: Callable[[Event], None]
    ) -> None:
        """As run() does, with each token's logprob entry beside its text."""
        from serve.llm.logprobs import token_entry

        scored: list = []  # the engine hands each token's TokenLogprob before it yields the token
        for _, piece in self.generator.generate(prompt_ids, sampling, generation.cancel.is_set, scored.append):
            observe_token(self.metrics, generation)
            post(Token(piece, token_entry(self.generator, scored.pop())))

    async def stop(self) -> None:
        """Drain: let queued and running generations finish, then release the thread."""
        self.closing = True
        while self.pending:
            await asyncio.sleep(0.05)
        self.executor.shutdown(wait=True)
