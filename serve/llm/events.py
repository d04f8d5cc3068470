"""What a generation hands the routes, whichever service produced it: its events (a token, then its
end or its failure), the per-token metrics both services count, and the queue interface the routes
submit to (GenerationQueue: serve/llm/service.py's one-at-a-time service and serve/llm/batching.py's
continuous batching both meet it)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Union

if TYPE_CHECKING:
    from engines.generation import Sampling


@dataclass(frozen=True)
class Token:
    """A piece of generated text, with its logprob entry (serve/llm/logprobs.py) where the request
    asked for logprobs."""

    text: str
    logprob: dict | None = None


@dataclass(frozen=True)
class End:
    """The generation ended: "stop" (the model's end or a stop string), "length" (max tokens) or
    "cancelled" (the request left before it started)."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """The generation failed: the error its request is answered with."""

    error: Exception


Event = Union[Token, End, Failed]


@dataclass
class Generation:
    """One request's stream of events: Tokens, then one End or Failed."""

    events: asyncio.Queue[Event]
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    first_at: float = 0.0  # perf_counter() of the first token
    last_at: float = 0.0  # ... and of the latest one


class GenerationQueue(Protocol):
    """The bounded queue in front of a generating engine, as the routes use it: a full one refuses at
    once (429), a closing or broken one with a 503."""

    # Requests read or tokenized right now (serve.body.arriving): a queue that forms batches waits
    # for them; one that does not, ignores the count.
    arriving: int

    def submit(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        """Queue one generation; its events arrive on the returned Generation's queue."""
        ...

    async def stop(self) -> None:
        """Drain: let queued and running generations finish, then release the engine's thread."""
        ...


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
