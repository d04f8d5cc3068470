"""Continuous batching for causal LMs: one engine shared by every request, one thread driving it.

The engine does the scheduling: engines.openvino.genai_batch.OVGenAIBatchEngine (OpenVINO GenAI's
continuous-batching pipeline: which prompts to prefill, in what chunks, beside which running decodes)
or engines.onnxruntime_genai.batch.GenAIBatchEngine (ONNX Runtime GenAI's Engine, which on a CPU model runs
static batches). This module only decides what enters the engine and carries tokens out of it:

- Admission knows the KV cache. A request enters the engine only when the blocks it may need at its
  longest (prompt + max_tokens) fit beside those reserved by the sequences already running, and fewer
  than --max-num-seqs are running. So the engine never has to preempt a running stream for a new one:
  a stream already going keeps its blocks to the end. Requests that do not fit yet wait here, in
  arrival order, up to --max-queue of them (429 past that); one that could never fit was refused
  with a 400 before it got here (GenerativeModel.check_fits).
- An engine that batches statically (its format's row says batching="static") takes no request into a
  batch once it runs: the next batch is admitted when the engine holds none, sized by what it
  allocates (every row as long as the batch's longest), after waiting a moment (at most the engine's
  `gather_s`) for as many requests as the last batch had: clients that finished together come back a
  little apart, and should share the next batch instead of waiting a whole generation for each other.
- Cancellation is immediate: a request whose client left, hit a stop string or timed out is cancelled
  in the engine before the next step, which frees its sequence and KV blocks there (a static batch
  keeps computing its row until the batch ends; the request is gone from the server's counts at once).
- After every step each running request's new tokens are decoded and posted to its own asyncio queue,
  the same events the one-at-a-time service posts.
- A failed engine step fails no more than it must. The engines fail a step on what a request's
  constraint makes them compile or force (serve/llm/structured.py bounds what is known to), and neither
  steps again after that (OpenVINO GenAI's pipeline fails every later step; ONNX Runtime GenAI's
  Engine says it is "no longer healthy"). So the engine is rebuilt in the process (a new pipeline
  from the artifact's files, or a new Engine on the model already loaded: seconds, and the server
  stays up), the
  request that caused the failure gets a 400 (one the engine reported as failed, else those whose
  constraint had not yet produced a token), and every other running request is handed to the new
  engine where it stopped (its prompt and the tokens it has, for the tokens it has left); one whose
  constraint is already part-way gets a 500. An engine that cannot be rebuilt, or fails
  MAX_FAILED_STEPS steps in a row, is broken: every request is failed with a 503, the server is
  marked not ready with the reason (/v2/health/ready and /live answer 503) and `on_broken` asks the
  process to exit non-zero, so its orchestrator replaces it.
- Capacity is counted in the engine's own blocks (KVCapacity): how many sequences of the recipe's
  declared request shape fit the cache at once, printed at startup and exported in /metrics. With
  prompt lookup, each decode step's accepted tokens are counted there too.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

from serve.errors import HTTPError, bad_request, busy, unavailable
from serve.llm.events import End, Event, Failed, Generation, Token, observe_end, observe_token
from serve.llm.logprobs import token_entry

if TYPE_CHECKING:
    from engines.generation import BatchEngine, Sampling, StaticBatchEngine
    from serve.llm.model import GenerativeModel

log = logging.getLogger("serve")
# The sequence length capacity is reported for when the recipe declared no request shape.
DEFAULT_SEQUENCE_TOKENS = 1024
# Failed steps in a row (none succeeding between) after which the engine is given up: a failure a
# rebuilt engine meets again is not one request's.
MAX_FAILED_STEPS = 3


def declared_sequence_tokens(manifest: dict | None) -> int:
    """Prompt + output tokens of the longest request shape the artifact's recipe declared (the
    workload its manifest records), else DEFAULT_SEQUENCE_TOKENS."""
    workload = ((manifest or {}).get("metrics") or {}).get("workload") or {}
    shapes = [r for r in workload.get("requests") or [] if isinstance(r, dict)] if workload.get("declared") else []
    lengths = [int(r.get("prompt") or 0) + int(r.get("output") or 0) for r in shapes]
    return max(lengths) if lengths and max(lengths) > 0 else DEFAULT_SEQUENCE_TOKENS


@dataclass(frozen=True)
class KVCapacity:
    """What the engine's KV cache holds, in its own blocks: `sequences` concurrent sequences of
    `sequence_tokens` tokens each (every one reserving its blocks at its longest, as admission does)."""

    blocks: int
    block_tokens: int
    cache_bytes: int
    sequence_tokens: int
    sequences: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens

    @property
    def tokens_per_gb(self) -> float:
        return self.tokens / (self.cache_bytes / 2**30) if self.cache_bytes else 0.0

    @property
    def sequences_per_gb(self) -> float:
        return self.sequences / (self.cache_bytes / 2**30) if self.cache_bytes else 0.0

    def describe(self) -> str:
        return (
            f"KV cache {self.blocks} blocks of {self.block_tokens} tokens in {self.cache_bytes / 2**30:.3f} GB: "
            f"{self.tokens} tokens ({self.tokens_per_gb:,.0f} per GB), {self.sequences} concurrent sequences "
            f"of {self.sequence_tokens} tokens"
        )


def kv_capacity(engine: BatchEngine, sequence_tokens: int) -> KVCapacity:
    sequences = engine.num_blocks // max(1, engine.blocks_for(sequence_tokens))
    return KVCapacity(engine.num_blocks, engine.block_tokens, int(engine.kv_cache_bytes), sequence_tokens, sequences)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


def suspected(sequence: Sequence) -> bool:
    """Whether a request is what made the engine's step fail: one the engine reported as failed, or
    one whose constraint has not produced a token yet (the engines compile it when it first samples)."""
    if getattr(sequence.handle, "error", None):
        return True
    return sequence.sampling.constraint is not None and not sequence.ids


def request_failure(sequence: Sequence, exc: Exception) -> HTTPError:
    """What a request the engine failed is answered: a 400 where its constraint is what the engine
    could not apply, else a 500 for it alone."""
    reason = one_line(exc)
    if sequence.sampling.constraint is not None:
        return bad_request(f"the engine could not apply this request's constraint: {reason}")
    return HTTPError(500, f"the engine failed this request: {reason}", "server_error")


@dataclass
class Sequence:
    """One request: its events queue, what it reserved in the KV cache, and its text so far."""

    generation: Generation
    prompt_ids: list[int]
    sampling: Sampling
    blocks: int  # KV blocks reserved for it at its longest
    post: Any  # posts an event to the request's queue from this thread
    handle: Any = None  # the engine's handle (engines.generation.BatchHandle) once admitted
    ids: list[int] | None = None
    emitted: str = ""
    text_stream: object = None  # the engine's streaming detokenizer, where it has one

    def push(self, event: Event) -> None:
        self.post(self.generation.events.put_nowait, event)


class PrefixCacheCounter:
    """Prefix-cache hits as the engine's cache would find them: whole KV blocks of a prompt whose
    content and everything before it match blocks an earlier prompt filled, remembered most recently
    used first for as many blocks as the cache holds. OpenVINO GenAI does not report its own hits,
    so this is the server's count of what was there to reuse."""

    def __init__(self, block_tokens: int, capacity_blocks: int):
        self.block_tokens, self.capacity = block_tokens, capacity_blocks
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def lookup(self, prompt_ids: list[int]) -> int:
        """Tokens of this prompt found in the cache; the prompt's blocks are remembered after it."""
        hits, chain, missed = 0, 0, False
        for start in range(0, len(prompt_ids) - self.block_tokens + 1, self.block_tokens):
            chain = hash((chain, tuple(prompt_ids[start : start + self.block_tokens])))
            if not missed and chain in self.blocks:
                hits += self.block_tokens
            else:
                missed = True
            self.blocks[chain] = None
            self.blocks.move_to_end(chain)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hits


class ContinuousBatchingService:
    """A GenerationQueue (serve/llm/events.py) over an engine that batches continuously."""

    def __init__(
        self,
        model: GenerativeModel,
        max_queue: int,
        metrics=None,
        manifest: dict | None = None,
        on_broken: Callable[[str], None] = lambda reason: None,
    ):
        assert model.batch_engine is not None
        self.model = model
        self.engine: BatchEngine = model.batch_engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.starting: list[Sequence] = []  # admitted, not yet handed to the engine
        self.reserved = 0  # KV blocks reserved by the admitted and running sequences
        self.ids = itertools.count()
        self.wakeup = threading.Condition()
        self.closing = False
        self.cancelled = False  # a sequence was cancelled since the last step
        self.failed_steps = 0  # engine steps failed since the last that succeeded
        self.broken: str | None = None  # why the engine was given up (see the module doc)
        self.on_broken = on_broken
        # The row's word that this engine batches statically is what makes it a StaticBatchEngine.
        self.static: StaticBatchEngine | None = (
            cast("StaticBatchEngine", self.engine) if model.batching == "static" else None
        )
        self.last_batch = 0  # requests the last static batch started with
        # Requests read or tokenized right now (serve.body.arriving, on the event loop): a static batch
        # being formed waits for them too, so sixteen clients that start together after one lone
        # request (a warm-up, say) do not start with a batch of one that the other fifteen wait behind.
        self.arriving = 0
        self.prefixes = (
            PrefixCacheCounter(self.engine.block_tokens, self.engine.num_blocks)
            if self.engine.settings.prefix_caching
            else None
        )
        self.capacity = kv_capacity(self.engine, declared_sequence_tokens(manifest))
        self.proposed_per_step = int(getattr(self.engine, "proposed_per_step", 0))  # 0: no speculation
        self.speculated = [0, 0]  # speculative decode steps of all sequences, tokens they accepted
        log.info("serve: %s", self.capacity.describe())
        if metrics:
            metrics.observe_kv_capacity(self.capacity, getattr(self.engine, "kv_cache_precision", ""))
        self.thread = threading.Thread(target=self.loop, name="generate-batch", daemon=True)
        self.thread.start()

    @property
    def pending(self) -> int:
        return len(self.waiting) + len(self.starting) + len(self.running)

    # --- on the event loop -------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        if self.broken:
            raise unavailable(f"the engine failed and could not be restarted: {self.broken}", retry_after_s=60)
        if self.closing:
            raise unavailable("the model is not accepting requests")
        loop = asyncio.get_running_loop()
        generation = Generation(asyncio.Queue())
        blocks = self.engine.blocks_for(len(prompt_ids) + sampling.max_new_tokens)
        sequence = Sequence(generation, prompt_ids, sampling, blocks, loop.call_soon_threadsafe)
        with self.wakeup:
            # Admitted here, not later in the scheduling thread, so that what is refused does not depend
            # on how far that thread has got: a request that fits now is admitted, one that must wait
            # takes a place in the queue, and with every place taken it is a 429.
            self.admit()
            if self.waiting or not self.fits(sequence):
                if len(self.waiting) >= self.max_queue:
                    raise busy()
                self.waiting.append(sequence)
            else:
                self.reserve(sequence)
            self.wakeup.notify()
        return generation

    async def stop(self) -> None:
        """Drain: let waiting and running generations finish, then end the scheduling thread."""
        with self.wakeup:
            self.closing = True
            self.wakeup.notify()
        while self.thread.is_alive():
            await asyncio.sleep(0.05)

    # --- in the scheduling thread ------------------------------------------------------------------

    def loop(self) -> None:
        while True:
            with self.wakeup:
                self.admit()
                if self.static and self.starting:
                    self.gather()
                    self.last_batch = len(self.starting)
                starting, self.starting = self.starting, []
                if not starting and not self.running and not self.cancelled:
                    if self.closing and not self.waiting:
                        return
                    self.observe()
                    self.wakeup.wait(timeout=1.0)
                    continue
            for sequence in starting:
                self.start(sequence)
            self.cancel_abandoned()
            try:
                # A step also after the last sequence was cancelled: that is when the engine frees its blocks.
                if self.engine.has_work() or self.cancelled:
                    self.cancelled = False
                    self.engine.step()
                    self.failed_steps = 0
            except Exception as exc:  # the engine failed: rebuilt, or given up (see the module doc)
                self.step_failed(exc)
                continue
            self.deliver()
            self.observe()
            # The engines' step() holds the GIL for the whole step (measured: a Python thread beside
            # OpenVINO GenAI's step() runs only between steps). Without this the event loop, woken by
            # the tokens just posted, waits for the next step to end before it sends them: one decode
            # step added to every token's latency, the first one's included. Releasing the GIL here
            # lets it send them first.
            time.sleep(0)

    def fits(self, sequence: Sequence) -> bool:
        """Whether it can enter the engine beside what is there, never preempting a running stream."""
        taken = len(self.running) + len(self.starting)
        if taken >= self.engine.settings.max_num_seqs:
            return False
        static = self.static
        if static is not None:  # only into the batch being formed, while the engine holds none
            if self.starting and any(static.runs_alone(s.sampling) for s in (*self.starting, sequence)):
                return False
            blocks = [s.blocks for s in self.starting] + [sequence.blocks]
            idle = not self.running and not static.in_flight
            return idle and static.batch_blocks(blocks) <= static.num_blocks
        return self.reserved + sequence.blocks <= self.engine.num_blocks

    def gather(self) -> None:
        """Before a static batch starts, wait up to the engine's gather_s until it has as many
        requests as the last one had (a full batch the first time), or as are on their way in now
        if more: one client alone is not kept waiting, clients that come back together share a batch
        (called with the lock held; submit() notifies)."""
        static = self.static
        assert static is not None
        deadline = time.perf_counter() + static.gather_s
        full = static.settings.max_num_seqs
        alone = static.runs_alone(self.starting[0].sampling)

        def target() -> int:
            return min(max(self.last_batch or full, len(self.starting) + self.arriving), full)

        while not alone and len(self.starting) < target():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self.wakeup.wait(timeout=left)
            self.admit()

    def reserve(self, sequence: Sequence) -> None:
        self.reserved += sequence.blocks
        self.starting.append(sequence)

    def admit(self) -> None:
        """Admit waiting requests, oldest first, while they fit (called with the lock held)."""
        while self.waiting:
            sequence = self.waiting[0]
            if sequence.generation.cancel.is_set():  # gone while it waited
                self.waiting.popleft()
                sequence.push(End("cancelled"))
                continue
            if not self.fits(sequence):
                return  # first come, first served: later requests wait behind this one
            self.reserve(self.waiting.popleft())

    def start(self, sequence: Sequence) -> None:
        """Hand an admitted request to the engine (its blocks are already reserved)."""
        if sequence.generation.cancel.is_set():
            return self.release(sequence, "cancelled")
        request_id = next(self.ids)
        try:
            sequence.handle = self.engine.add(request_id, sequence.prompt_ids, sequence.sampling)
        except Exception as exc:
            sequence.push(Failed(exc))
            return self.release(sequence, None)
        sequence.ids = []
        if hasattr(self.engine, "text_stream"):  # optional: a streaming detokenizer per request (None: none)
            sequence.text_stream = self.engine.text_stream()
        self.running[request_id] = sequence
        if self.metrics:
            self.metrics.request_queue_time.observe(time.perf_counter() - sequence.generation.started)
            if self.prefixes is not None:
                self.metrics.prefix_queries.inc(len(sequence.prompt_ids))
                self.metrics.prefix_hits.inc(self.prefixes.lookup(sequence.prompt_ids))

    def cancel_abandoned(self) -> None:
        """Cancel in the engine every request nobody waits for any more; the next step frees its blocks."""
        for request_id, sequence in list(self.running.items()):
            if sequence.generation.cancel.is_set():
                sequence.handle.cancel()
                self.cancelled = True
                self.finish(request_id, "cancelled")

    def deliver(self) -> None:
        """Hand each running request the tokens of the last step, as text pieces."""
        for request_id, sequence in list(self.running.items()):
            try:
                new, done = self.engine.read(sequence.handle)
            except Exception as exc:  # the engine failed this request alone
                sequence.push(Failed(request_failure(sequence, exc)))
                self.finish(request_id, None)
                continue
            if self.proposed_per_step:
                self.count_speculation(getattr(sequence.handle, "last_accepted", None))
            scored = self.engine.read_logprobs(sequence.handle) if sequence.sampling.logprobs else []
            for i, token in enumerate(new):
                self.emit(sequence, token, token_entry(self.engine, scored[i]) if scored else None)
            if done:
                observe_end(self.metrics, sequence.generation)
                length = sequence.generation.tokens >= sequence.sampling.max_new_tokens
                self.finish(request_id, "length" if length else "stop")

    def count_speculation(self, accepted: int | None) -> None:
        """One sequence's speculative decode step (None: its step was not one)."""
        if accepted is None:
            return
        self.speculated[0] += 1
        self.speculated[1] += accepted
        if self.metrics:
            self.metrics.observe_speculation(accepted, self.proposed_per_step, *self.speculated)

    def emit(self, sequence: Sequence, token: int, entry: dict | None = None) -> None:
        assert sequence.ids is not None
        sequence.ids.append(token)
        if sequence.text_stream is not None:
            return self.push_piece(sequence, sequence.text_stream.decode(token), entry)  # type: ignore[attr-defined]
        text = self.engine.decode(sequence.ids)
        # Hold back an incomplete UTF-8 sequence (the decoder shows it as U+FFFD) until the token that
        # completes it arrives.
        piece = "" if text.endswith("\ufffd") else text[len(sequence.emitted) :]
        self.push_piece(sequence, piece, entry)

    def push_piece(self, sequence: Sequence, piece: str, entry: dict | None = None) -> None:
        sequence.emitted += piece
        observe_token(self.metrics, sequence.generation)
        sequence.push(Token(piece, entry))

    def finish(self, request_id: int, reason: str | None) -> None:
        self.release(self.running.pop(request_id), reason)

    def release(self, sequence: Sequence, reason: str | None) -> None:
        with self.wakeup:
            self.reserved -= sequence.blocks
        if reason is not None:
            sequence.push(End(reason))

    def step_failed(self, exc: Exception) -> None:
        """The engine's step raised: the suspects get their 400, the rest go on in a rebuilt engine;
        an engine that cannot be rebuilt, or keeps failing, is given up."""
        reason = one_line(exc)
        log.error("serve: the engine failed a step (%s); rebuilding it", reason, exc_info=exc)
        self.failed_steps += 1
        rebuild = getattr(self.engine, "rebuild", None)
        if rebuild is None or self.failed_steps > MAX_FAILED_STEPS:
            return self.give_up(reason if rebuild else f"{reason} (this engine cannot be rebuilt)")
        survivors, failures = [], []
        for request_id, sequence in list(self.running.items()):
            if suspected(sequence):
                failures.append((sequence, request_failure(sequence, exc)))
            elif sequence.sampling.constraint is not None and sequence.ids:  # its grammar state is lost
                failures.append((sequence, HTTPError(500, f"the engine failed a step: {reason}", "server_error")))
            else:
                survivors.append(self.running.pop(request_id))
                continue
            self.release(self.running.pop(request_id), None)
        try:
            rebuild()
        except Exception as rebuild_exc:
            self.running.update((next(self.ids), s) for s in survivors)
            self.give_up(f"{reason}; rebuilding it failed: {one_line(rebuild_exc)}")
        else:
            for sequence in survivors:
                self.resume(sequence)
        # Their answers go out only now, so a client that reads its error next finds the server
        # settled: serving again, or marked broken.
        for sequence, failure in failures:
            sequence.push(Failed(failure))

    def resume(self, sequence: Sequence) -> None:
        """Hand a running request to the rebuilt engine: its prompt and the tokens it has, for the
        tokens it has left (its reserved blocks cover the same total)."""
        from dataclasses import replace

        done = list(sequence.ids or [])
        left = sequence.sampling.max_new_tokens - len(done)
        request_id = next(self.ids)
        try:
            sequence.handle = self.engine.add(
                request_id, sequence.prompt_ids + done, replace(sequence.sampling, max_new_tokens=max(1, left))
            )
        except Exception as exc:
            sequence.push(Failed(request_failure(sequence, exc)))
            return self.release(sequence, None)
        self.running[request_id] = sequence

    def give_up(self, reason: str) -> None:
        """The engine is broken: every request fails with a 503, nothing more is taken, and on_broken
        (the server: not ready, exit non-zero) is told why."""
        log.error("serve: the engine is broken and the server stops taking requests: %s", reason)
        self.broken = reason
        error = unavailable(f"the engine failed and could not be restarted: {reason}", retry_after_s=60)
        with self.wakeup:
            self.closing = True
            pending = [*self.waiting, *self.starting]
            self.waiting.clear()
            self.starting = []
        for sequence in pending:
            sequence.push(Failed(error))
            self.release(sequence, None)
        for request_id, sequence in list(self.running.items()):
            sequence.push(Failed(error))
            self.finish(request_id, None)
        self.on_broken(reason)

    def observe(self) -> None:
        if not self.metrics:
            return
        self.metrics.running.set(len(self.running) + len(self.starting))
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.queue_depth.set(len(self.waiting))
        # The engine's figure is as of its last step; with no sequence left in it, no block is in use
        # (it does not step when idle, so it would go on reporting the last sequence's blocks).
        busy = self.running or self.engine.has_work()
        self.metrics.kv_cache_usage.set(self.engine.cache_usage() if busy else 0.0)
