"""ONNX Runtime GenAI runner for causal LMs: prompt in, tokens out, one token at a time.

A causal-LM artifact's engine block reads {"format": "onnxruntime-genai", "dir": SUBDIR, "task":
"causal_lm", ...}; SUBDIR holds genai_config.json, the ONNX decoder with its KV cache, and the
tokenizer files the GenAI builder writes. Torch-free: serve/ uses this directly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from engines.generation import (
    FALLBACK_CHAT_TEMPLATE,
    BatchEngine,
    BatchSettings,
    Sampling,
    ScoringGenerator,
    StaticBatchEngine,
    refuse_unhonoured,
    token_logprobs,
)
from engines.hardware import usable_cores

ENGINE = "onnxruntime-genai"


def genai_dir(root: Path, engine: dict) -> Path:
    return root / engine.get("dir", ".")


class GenAIRunner:
    # The Runner contract: {"input_ids": [B, T]} -> {"logits": [B, T, vocab]} (see __call__).
    input_names = ["input_ids"]
    output_names = ["logits"]

    def __init__(self, model_dir: str | Path, threads: int = 0, providers: list[str] | None = None):
        try:
            import onnxruntime_genai as og
        except ImportError:
            raise RuntimeError("causal-LM artifacts need onnxruntime-genai: pip install onnxruntime-genai") from None
        self.og = og
        self.dir = Path(model_dir)
        settings = json.loads((self.dir / "genai_config.json").read_text())["model"]
        self.context_length = int(settings.get("context_length") or 2048)
        self.vocab_size = int(settings.get("vocab_size") or 0)
        config = og.Config(str(self.dir))
        # The decoder's intra-op threads, always set: left to ONNX Runtime GenAI's default, SmolLM2 INT4
        # decoded at 151 tok/s with a 94 ms first token on a 2-core AMD EPYC, against 229 tok/s and
        # 57 ms with the thread count set to the 2 cores. threads=0 means every core this process may use.
        threads = threads or usable_cores()
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)
        self.eos_token_ids = set(int(t) for t in self.tokenizer.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The model's own chat template when it has one, a plain role-tagged one otherwise."""
        payload = json.dumps(messages)
        extra = {"tools": json.dumps(tools)} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(payload, add_generation_prompt=True, **extra)
        except Exception:  # no template in the folder (GenAI raises a generic error)
            return self.tokenizer.apply_chat_template(
                payload, template_str=FALLBACK_CHAT_TEMPLATE, add_generation_prompt=True, **extra
            )

    def generate(
        self, prompt_ids: list[int], sampling: Sampling, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) until EOS, max_new_tokens, the context end, or cancellation."""
        refuse_unhonoured(sampling, ENGINE)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(**self.search_options(len(prompt_ids), sampling))
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(prompt_ids)
        stream = self.tokenizer.create_stream()
        produced = 0
        while produced < sampling.max_new_tokens and not generator.is_done() and not cancelled():
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            produced += 1
            if token in self.eos_token_ids:
                return
            yield token, stream.decode(token)

    def search_options(self, prompt_length: int, sampling: Sampling) -> dict:
        options: dict[str, Any] = {
            "max_length": min(self.context_length, prompt_length + sampling.max_new_tokens),
            "do_sample": sampling.temperature > 0,
        }
        if sampling.temperature > 0:
            # OpenAI semantics: temperature and top_p only, so top-k must not cut anything.
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=self.vocab_size or 1 << 20)
            if sampling.seed is not None:
                options["random_seed"] = sampling.seed
        return options

    # What one decode step reads from memory, for the report's roofline (optimize/evaluate/roofline.py).

    def weight_bytes_per_token(self):
        """Bytes of weights read per generated token: the decoder's ONNX initializers as stored
        (MatMulNBits packed weights, scales, zero points), gathered tables one row per token."""
        from engines.weights import onnx_weight_bytes

        return onnx_weight_bytes(self._decoder_path())

    def kv_shape(self):
        """Layers, KV heads, head size (genai_config.json) and KV element bytes (the ONNX past inputs)."""
        from engines.weights import kv_shape_from_genai_config, onnx_kv_dtype_bytes

        config = json.loads((self.dir / "genai_config.json").read_text())
        return kv_shape_from_genai_config(config, onnx_kv_dtype_bytes(self._decoder_path()) or 4)

    def _decoder_path(self) -> Path:
        config = json.loads((self.dir / "genai_config.json").read_text())
        return self.dir / config["model"]["decoder"].get("filename", "model.onnx")

    # Scoring and timing, used by the pipeline's causal-LM evaluation (optimize/evaluate/generation.py).

    def _generator(self, max_length: int, min_length: int = 0):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(
            do_sample=False, max_length=min(max_length, self.context_length), min_length=min_length
        )
        return self.og.Generator(self.model, params)

    def logits(self, ids) -> np.ndarray:
        """Logits at every position of one sequence, in one forward pass: [T, vocab]."""
        ids = np.asarray(ids, dtype=np.int32)
        generator = self._generator(len(ids) + 1)
        generator.append_tokens(ids)
        return np.asarray(generator.get_output("logits"))[0, : len(ids)]

    def log_likelihood(self, ids, start: int = 1) -> np.ndarray:
        """log p(token i | the tokens before it) for each i >= start (start >= 1)."""
        return token_logprobs(self.logits(ids), ids)[start - 1 :]

    def __call__(self, inputs: dict) -> dict:
        return {"logits": np.stack([self.logits(row) for row in inputs["input_ids"]]).astype(np.float32)}

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        """Greedy decoding of exactly `new_tokens` tokens (EOS may not end it early): perf_counter()
        after each token. The prefill runs inside this call, so [0] minus the caller's start is the time
        to first token."""
        prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
        generator = self._generator(len(prompt_ids) + new_tokens, min_length=len(prompt_ids) + new_tokens)
        generator.append_tokens(prompt_ids)
        stamps = []
        for _ in range(new_tokens):
            generator.generate_next_token()
            stamps.append(time.perf_counter())
        return stamps


def load_genai_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> GenAIRunner:
    """Runner from an engine block: {'format': 'onnxruntime-genai', 'dir': SUBDIR, ...}."""
    return GenAIRunner(genai_dir(Path(root), engine), threads=threads, providers=engine.get("providers"))


# --- many generations at once: onnxruntime-genai's Engine --------------------------------------------

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
        """Whether a request needs a batch of its own: a seeded sampled one. The static Engine takes no
        seed per request ("A per-turn seed requires an Engine configured for dynamic batching"), so it
        runs through a Generator as it would one at a time, and gives the same text for the same seed."""
        return sampling.temperature > 0 and sampling.seed is not None

    def batch_blocks(self, blocks: list[int]) -> int:
        """KV blocks a static batch of these sequences allocates: every row as long as its longest."""
        return len(blocks) * max(blocks, default=0)

    def add(self, request_id: int, prompt_ids: list[int], sampling: Sampling) -> GenAIRequestHandle:
        """Queue a generation in the engine; returns its handle. request_id is the service's (the
        engine names requests by their object)."""
        refuse_unhonoured(sampling, ENGINE)
        session = min(self.context_length, len(prompt_ids) + sampling.max_new_tokens)
        if self.runs_alone(sampling):
            handle = GenAIRequestHandle(None, 0, session, [])
            handle.alone = self.generate(prompt_ids, sampling, lambda: handle.cancelled)
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
        if sampling.temperature > 0:  # OpenAI semantics: temperature and top_p only, top-k cuts nothing
            turn.set_temperature(sampling.temperature)
            turn.set_top_p(sampling.top_p)
            turn.set_top_k(0)
            if sampling.seed is not None:
                turn.set_seed(sampling.seed)

    def step(self) -> None:
        """One engine run: each event's token goes to its request's handle (or one token of a
        request that runs alone: the service gives it a batch of its own)."""
        for alone in [h for h in self.handles.values() if h.alone is not None and not h.finished]:
            self.step_alone(alone)
        token_flag, finished_flag, failed_flag = (
            int(f.value) for f in (self.flags.TOKEN, self.flags.TURN_FINISHED, self.flags.FAILED)
        )
        for event in self.engine.run(self.events):
            handle = self.handles.get(id(event.request))
            if handle is None:
                continue
            flags = int(event.flags.value)
            if flags & token_flag and int(event.token) not in self.eos_token_ids:
                handle.tokens.append(int(event.token))
            if flags & failed_flag:
                handle.error = f"onnxruntime-genai failed the request: {event.error_code.name}"
            if flags & (finished_flag | failed_flag) and not handle.finished:
                handle.finished = True
                self.in_flight -= 1
                if handle.cancelled:  # nobody reads it any more
                    self.close(handle)

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
        if handle.finished:
            self.close(handle)
        return new, handle.finished


def load_genai_batch_engine(
    root: Path, engine: dict, settings: BatchSettings, threads: int = 0, spinning: bool = True
) -> GenAIBatchEngine:
    """The batching engine of an {"format": "onnxruntime-genai", ...} artifact (what serve runs when it
    takes several requests at once). `spinning` is taken for the loader signature; the GenAI decoder's
    threads do not spin."""
    return GenAIBatchEngine(genai_dir(Path(root), engine), settings, threads=threads)


# mypy checks that both classes implement the generation interface (engines/generation.py).
_generator: type[ScoringGenerator] = GenAIRunner
_batch_engine: type[BatchEngine] = GenAIBatchEngine
_static_batch_engine: type[StaticBatchEngine] = GenAIBatchEngine
