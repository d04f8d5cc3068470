"""ONNX Runtime GenAI's Engine for causal LMs: many generations at once (what serve runs when it
takes several requests at once). On a CPU model it batches statically; the one-at-a-time runner it
builds on is engines/onnxruntime_genai/runner.py. Torch-free: serve/ uses this directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from engines.generation import (
    BatchEngine,
    BatchSettings,
    Sampling,
    StaticBatchEngine,
    TokenLogprob,
    refuse_unhonoured,
)
from engines.onnxruntime_genai.runner import ENGINE, GENERATOR_HONOURS, GenAIRunner, genai_dir, guidance

# What onnxruntime-genai 0.18's Engine does with a model built without PagedAttention (every CPU
# build: its builder makes PagedAttention models for CUDA and WebGPU only): static batching. Up to
# this many requests start together in one batch and run until its longest ends; a request added
# meanwhile waits for the batch to end; a cancelled request's row stays in the batch, computed until
# then. Its static scheduler cuts batches at 4 whatever `engine.static_batching.max_batch_size` says
# (measured: 8 requests with that set to 8 ran as two batches of 4). Continuous batching, a paged KV
# cache and prefix caching are its dynamic path, which needs a PagedAttention model.
GENAI_STATIC_BATCH = 4
# How long an idle static engine may wait for more requests before starting a batch: clients that
# finished together come back a little apart (tens of milliseconds on a loaded 2-core machine), and a
# batch started with one of them makes the rest wait for that whole generation. The service waits only
# for as many as the last batch had, so a lone client is not kept waiting.
GENAI_BATCH_GATHER_S = 0.05


@dataclass
class GenAIRequestHandle:
    """One request in the Engine: its tokens since the last read, whether its turn ended, and why."""

    request: Any  # og.Request; None for a request that runs alone through a Generator
    turn_id: int
    session_tokens: int  # prompt + new tokens: the KV rows its batch allocates for it
    tokens: list[int]
    finished: bool = False
    cancelled: bool = False
    error: str | None = None
    alone: Iterator[tuple[int, str]] | None = None  # GenAIRunner.generate() of a request run alone
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `tokens` (a request run alone)
    last_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens the last read returned

    def cancel(self) -> None:
        """Ends the turn at the engine's next step (called from the thread that steps the engine)."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            if self.request is not None:
                self.request.cancel_turn(self.turn_id)


class GenAIBatchEngine(GenAIRunner):
    """Many generations at once through onnxruntime-genai's own Engine: requests are added with
    add(), the caller drives step(), and each request's handle gives back the tokens of that step.
    The engine schedules; with a CPU model that means static batches (GENAI_STATIC_BATCH): the
    service admits a new batch only when the engine holds none (its format row says batching="static").

    The KV cache of a static batch is one block of batch size x its longest session (prompt +
    max_tokens), so blocks here are single tokens: `num_blocks` tokens of KV fit in
    settings.kv_cache_bytes, and a batch of n requests holds n x its longest."""

    gather_s = GENAI_BATCH_GATHER_S
    # The Engine's TurnOptions take top_k and repetition_penalty; logprobs come from a request run
    # alone through the Generator (the Engine's events carry no logits).
    honours = GENERATOR_HONOURS

    def __init__(self, model_dir: str | Path, settings: BatchSettings, threads: int = 0):
        from dataclasses import replace

        super().__init__(model_dir, threads=threads)
        self._engine: Any = None  # made by the thread that steps it (see `engine`)
        self.asked = settings
        # What the engine honours: its batch size, no prefix caching (it has none without PagedAttention).
        self.settings = replace(
            settings, max_num_seqs=min(settings.max_num_seqs, GENAI_STATIC_BATCH), prefix_caching=False
        )
        self.block_tokens = 1
        self.kv_token_bytes = self.kv_shape().bytes_per_token(1)
        self.num_blocks = max(1, settings.kv_cache_bytes // self.kv_token_bytes)
        self.kv_cache_bytes = self.num_blocks * self.kv_token_bytes
        self.handles: dict[int, GenAIRequestHandle] = {}  # by id() of the og.Request each event names
        self.batch: list[int] = []  # session tokens of the requests of the current (or last) batch
        # Requests in the engine whose turn has not ended: a plain count, read from the event loop's thread.
        self.in_flight = 0
        self.flags = self.og.EngineEventFlags

    @property
    def engine(self):
        """The og.Engine, made on first use: it answers only the thread that created it ("Engine
        operations must be called from the Engine owner thread"), which must be the one that steps it."""
        if self._engine is None:
            self._engine = self.og.Engine(self.model)
            self.events = self._engine.create_event_buffer(4 * GENAI_STATIC_BATCH)
        return self._engine

    def blocks_for(self, tokens: int) -> int:
        return tokens

    def describe(self) -> str:
        """The startup line: what it batches, and each setting it cannot honour."""
        asked, honoured = self.asked.max_num_seqs, self.settings.max_num_seqs
        clamp = f" (--max-num-seqs {asked} asked: its static batches hold {honoured})" if asked > honoured else ""
        return (
            f"static batching in ONNX Runtime GenAI's Engine, not continuous: up to {honoured} sequences "
            f"start together{clamp} and the next batch starts when the longest has ended, so a request that arrives "
            f"meanwhile waits and a cancelled sequence is computed until its batch ends; KV cache "
            f"{self.kv_cache_bytes / 2**20:.1f} MiB ({self.num_blocks} tokens; a batch takes its size x its longest "
            f"prompt + max_tokens); --max-batched-tokens not applied (a batch's prompts are prefilled whole); prefix "
            f"caching off; a seeded sampled request runs alone (the static Engine takes no seed per request). ONNX "
            f"Runtime GenAI batches continuously (paged KV cache, prefix caching) only with a "
            f"PagedAttention model, which its builder makes for CUDA and WebGPU, not for CPU"
        )

    def text_stream(self):
        """A streaming detokenizer for one request (decode(token) -> the text it completes). Decoding
        the whole id list instead would lose the text after an invalid byte: og's Tokenizer.decode
        stops there (the tiny test model's sampled ids showed it)."""
        return self.tokenizer.create_stream()

    def runs_alone(self, sampling: Sampling) -> bool:
        """Whether a request needs a batch of its own: a seeded sampled one, or one that asks for
        logprobs. The static Engine takes no seed per request ("A per-turn seed requires an Engine
        configured for dynamic batching") and its events carry no logits, so such a request runs
        through a Generator as it would one at a time (the same text for the same seed)."""
        return (sampling.temperature > 0 and sampling.seed is not None) or sampling.logprobs

    def batch_blocks(self, blocks: list[int]) -> int:
        """KV blocks a static batch of these sequences allocates: every row as long as its longest."""
        return len(blocks) * max(blocks, default=0)

    def add(self, request_id: int, prompt_ids: list[int], sampling: Sampling) -> GenAIRequestHandle:
        """Queue a generation in the engine; returns its handle. request_id is the service's (the
        engine names requests by their object)."""
        refuse_unhonoured(sampling, ENGINE, self.honours)
        session = min(self.context_length, len(prompt_ids) + sampling.max_new_tokens)
        if self.runs_alone(sampling):
            handle = GenAIRequestHandle(None, 0, session, [])
            handle.alone = self.generate(prompt_ids, sampling, lambda: handle.cancelled, handle.logprobs.append)
            self.handles[id(handle)] = handle
            self.begin(session)
            return handle
        options = self.og.RequestOptions()
        options.set_max_session_tokens(session)  # the KV rows its batch allocates (the config's 8192 otherwise)
        request = self.engine.create_request(options=options)
        turn = self.og.TurnOptions(request)
        self.turn_options(turn, sampling)
        turn_id = request.begin_turn(np.asarray(prompt_ids, dtype=np.int32), turn)
        handle = GenAIRequestHandle(request, turn_id, session, [])
        self.handles[id(request)] = handle
        self.begin(session)
        return handle

    def begin(self, session_tokens: int) -> None:
        if not self.in_flight:  # the engine holds no batch: this request starts the next one
            self.batch = []
        self.batch.append(session_tokens)
        self.in_flight += 1

    def turn_options(self, turn, sampling: Sampling) -> None:
        turn.set_max_generated_tokens(sampling.max_new_tokens)
        turn.set_do_sample(sampling.temperature > 0)
        if sampling.repetition_penalty != 1.0:
            turn.set_repetition_penalty(sampling.repetition_penalty)
        if sampling.temperature > 0:  # OpenAI semantics: temperature and top_p; top-k (0) cuts nothing unless asked
            turn.set_temperature(sampling.temperature)
            turn.set_top_p(sampling.top_p)
            turn.set_top_k(sampling.top_k)
            if sampling.seed is not None:
                turn.set_seed(sampling.seed)
        if sampling.constraint is not None:
            turn.set_guidance(*guidance(sampling.constraint))

    def step(self) -> None:
        """One engine run: each event's token goes to its request's handle (or one token of a
        request that runs alone: the service gives it a batch of its own)."""
        for alone in [h for h in self.handles.values() if h.alone is not None and not h.finished]:
            self.step_alone(alone)
        token_flag, finished_flag, failed_flag = (
            int(f.value) for f in (self.flags.TOKEN, self.flags.TURN_FINISHED, self.flags.FAILED)
        )
        failed = ""
        for event in self.engine.run(self.events):
            handle = self.handles.get(id(event.request))
            if handle is None:
                continue
            flags = int(event.flags.value)
            if flags & token_flag and int(event.token) not in self.eos_token_ids:
                handle.tokens.append(int(event.token))
            if flags & failed_flag:
                handle.error = failed = f"onnxruntime-genai failed the request: {event.error_code.name}"
            if flags & (finished_flag | failed_flag) and not handle.finished:
                handle.finished = True
                self.in_flight -= 1
                if handle.cancelled:  # nobody reads it any more
                    self.close(handle)
        if failed:
            # A failed request leaves the Engine "no longer healthy": every later call fails (measured).
            # The caller rebuilds it; the failed handle (its `error` set) is the one to blame.
            raise RuntimeError(f"{failed}; the Engine is no longer healthy")

    def rebuild(self) -> None:
        """A fresh Engine (made at its next use) after a failed run, its requests gone: an Engine whose
        run failed says it is "no longer healthy" and fails every later run; a new Engine on the same
        Model generates as the first did (measured)."""
        self._engine = None
        self.handles = {}
        self.in_flight = 0
        self.batch = []

    def step_alone(self, handle: GenAIRequestHandle) -> None:
        assert handle.alone is not None
        try:
            token, _ = next(handle.alone)
            handle.tokens.append(token)
        except StopIteration:
            self.finish_alone(handle)
        except Exception as exc:
            handle.error = f"onnxruntime-genai failed the request: {exc}"
            self.finish_alone(handle)

    def finish_alone(self, handle: GenAIRequestHandle) -> None:
        handle.finished = True
        self.in_flight -= 1
        if handle.cancelled:
            self.close(handle)

    def close(self, handle: GenAIRequestHandle) -> None:
        if handle.request is None:
            self.handles.pop(id(handle), None)
            return
        self.handles.pop(id(handle.request), None)
        handle.request.close()

    def has_work(self) -> bool:
        alone = any(h.alone is not None and not h.finished for h in self.handles.values())
        return alone or bool(self.engine.has_pending_requests())

    def cache_usage(self) -> float:
        """Fraction of the KV-cache budget the batch holds (0..1); it keeps its rows until it ends."""
        return min(1.0, self.batch_blocks(self.batch) / self.num_blocks) if self.in_flight else 0.0

    def read(self, handle: GenAIRequestHandle) -> tuple[list[int], bool]:
        """The tokens a handle produced since the last read (EOS left out), and whether it is done."""
        if handle.error:
            self.close(handle)
            raise RuntimeError(handle.error)
        new, handle.tokens = handle.tokens, []
        # A copy, then clear: the request's Generator appends to this very list (its on_logprob).
        handle.last_logprobs = handle.logprobs[:]
        handle.logprobs.clear()
        if handle.finished:
            self.close(handle)
        return new, handle.finished

    def read_logprobs(self, handle: GenAIRequestHandle) -> list[TokenLogprob]:
        return handle.last_logprobs


def load_genai_batch_engine(
    root: Path, engine: dict, settings: BatchSettings, threads: int = 0, spinning: bool = True
) -> GenAIBatchEngine:
    """The batching engine of an {"format": "onnxruntime-genai", ...} artifact (what serve runs when it
    takes several requests at once). `spinning` is taken for the loader signature; the GenAI decoder's
    threads do not spin."""
    return GenAIBatchEngine(genai_dir(Path(root), engine), settings, threads=threads)


# mypy checks that the class implements the generation interface (engines/generation.py).
_batch_engine: type[BatchEngine] = GenAIBatchEngine
_static_batch_engine: type[StaticBatchEngine] = GenAIBatchEngine
