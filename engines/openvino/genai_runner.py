"""OpenVINO GenAI runner for causal LMs: a ScoringGenerator (engines/generation.py), as
engines.onnxruntime_genai.runner.GenAIRunner is, so the causal-LM evaluation (optimize/tasks) and serve/
use either unchanged.

A causal-LM artifact's engine block reads {"format": "openvino-genai", "dir": SUBDIR,
"inference_precision": "f32" | "bf16", "kv_cache_precision": ..., "kv_cache_group_size": N,
"prompt_lookup": {"num_assistant_tokens": K, "max_ngram_size": N} (optional), "task": "causal_lm"}; SUBDIR holds
the stateful IR (openvino_model.xml), openvino_tokenizer.xml / openvino_detokenizer.xml and the
Hugging Face config files (engines/openvino/genai_build.py writes them).

Generation runs through `openvino_genai.LLMPipeline` (a streamer receives each token as it is
produced). Scoring (logits, log_likelihood) runs the same IR compiled with the same CPU properties,
directly: state reset, the sequence in forward passes, logits read back. A quantized KV cache (u8,
u4) is only read back for tokens of an earlier pass (measured: one pass over the whole sequence gives
the f32 cache's logits whatever the cache precision), so with one the sequence is scored in passes of
SCORING_CHUNK_TOKENS tokens, and perplexity is that of the cache generation reads. (Many generations
at once, continuous batching: engines/openvino/genai_batch.py.) Every numeric
property is set explicitly: the CPU plugin otherwise computes in bf16 on bf16 CPUs and stores the KV
cache in u8, and an artifact measured as FP32 must run as FP32. Torch-free: serve/ uses this directly.
"""

from __future__ import annotations

import abc
import json
import queue
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from engines.generation import (
    FALLBACK_CHAT_TEMPLATE,
    Constraint,
    Sampling,
    ScoringGenerator,
    TokenLogprob,
    UnsupportedSampling,
    padded_continuations,
    refuse_unhonoured,
    template_refusal,
    token_logprobs,
)
from engines.openvino.runner import PRECISIONS, compile_properties, require_cpu_features

ENGINE = "openvino-genai"
IR_FILE = "openvino_model.xml"
# KV-cache element types the CPU plugin takes. f32 needs f32 inference and bf16 bf16 inference (its
# paged attention refuses the other pairings); f16, u8 and u4 go with either. u8 and u4 keep keys by
# channel (a scale and zero point per channel for each block of tokens) and values by token (per group
# of kv_cache_group_size channels; 0: the head's width).
KV_CACHE_PRECISIONS = ("f32", "bf16", "f16", "u8", "u4")
QUANTIZED_KV = ("u8", "u4")
SCORING_CHUNK_TOKENS = 16  # tokens per scoring pass over a quantized KV cache
# Prompt lookup (n-gram speculation from the prompt, no draft model): tokens proposed per step and the
# longest n-gram matched, where the artifact or the server turns it on without saying.
PROMPT_LOOKUP_DEFAULTS = {"num_assistant_tokens": 5, "max_ngram_size": 3}
_DONE = object()
# The Sampling fields GenerationConfig carries for both pipelines (the constraint as a
# StructuredOutputConfig). LLMPipeline's streamer and result give no per-token log-probabilities; the
# continuous-batching pipeline's outputs do (for the chosen token only): engines/openvino/genai_batch.py
# adds "logprobs".
SAMPLING_HONOURS = ("constraint", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def resolve_kv_precision(inference_precision: str, kv_cache_precision: str | None) -> str:
    """The KV cache's element type (None: as the inference precision); a pairing the CPU plugin
    refuses is a ValueError naming it."""
    kv = kv_cache_precision or inference_precision
    if kv not in KV_CACHE_PRECISIONS:
        raise ValueError(f"kv_cache_precision {kv!r}: use one of {KV_CACHE_PRECISIONS}")
    if kv in ("f32", "bf16") and kv != inference_precision:
        raise ValueError(f"kv_cache_precision {kv} needs inference_precision {kv} (not {inference_precision})")
    return kv


def runner_properties(
    threads: int, inference_precision: str, kv_cache_precision: str | None, spinning: bool, kv_cache_group_size: int = 0
) -> dict:
    """CPU plugin properties shared by the pipeline and the scoring model."""
    properties = compile_properties(threads, inference_precision, "LATENCY", spinning)
    properties["KV_CACHE_PRECISION"] = resolve_kv_precision(inference_precision, kv_cache_precision)
    if kv_cache_group_size:
        if kv_cache_group_size < 0:
            raise ValueError(f"kv_cache_group_size {kv_cache_group_size}: a positive channel count, or 0")
        properties["KEY_CACHE_GROUP_SIZE"] = properties["VALUE_CACHE_GROUP_SIZE"] = kv_cache_group_size
    return properties


def head_dim(config: dict) -> int:
    heads = int(config.get("num_attention_heads") or 1)
    return int(config.get("head_dim") or int(config["hidden_size"]) // heads)


def check_kv_group(config: dict, group_size: int) -> None:
    """A KV-cache group size must divide the head's width (the plugin fails to compile otherwise)."""
    if group_size and head_dim(config) % group_size:
        raise ValueError(f"kv_cache_group_size {group_size} does not divide the head width {head_dim(config)}")


def prompt_lookup_settings(value) -> dict | None:
    """An engine block's or a server's prompt-lookup setting: None / False (off), True (the defaults)
    or {num_assistant_tokens, max_ngram_size} (missing ones from the defaults)."""
    if not value:
        return None
    given = value if isinstance(value, dict) else {}
    stray = set(given) - set(PROMPT_LOOKUP_DEFAULTS)
    if stray:
        raise ValueError(f"prompt_lookup takes {', '.join(PROMPT_LOOKUP_DEFAULTS)}, not {sorted(stray)}")
    settings = {**PROMPT_LOOKUP_DEFAULTS, **given}
    if any(not isinstance(v, int) or v < 1 for v in settings.values()):
        raise ValueError(f"prompt_lookup {settings}: every setting is a positive integer")
    return settings


class _TokenStreamer:
    """An openvino_genai.StreamerBase that hands each token id to `on_token` and stops the generation
    when `stop()` says so. Built lazily (the base class lives in openvino_genai)."""

    @staticmethod
    def make(ov_genai, on_token: Callable[[int], None], stop: Callable[[], bool], on_end=lambda: None):
        class Streamer(ov_genai.StreamerBase):
            def write(self, token):
                for t in token if isinstance(token, (list, tuple)) else [token]:
                    on_token(int(t))
                return ov_genai.StreamingStatus.CANCEL if stop() else ov_genai.StreamingStatus.RUNNING

            def end(self):
                on_end()

        return Streamer()


class OVGenAIText(abc.ABC):
    """What both OpenVINO GenAI engines share: the model's limits and EOS ids, its tokenizer and chat
    template, and the generation settings of a request. A subclass sets dir and tokenizer and says
    where the engine's default generation config comes from."""

    dir: Path
    tokenizer: Any
    eos_token_ids: set[int]
    honours: tuple[str, ...] = SAMPLING_HONOURS
    max_top_logprobs = 0
    ov_genai: Any  # the openvino_genai module
    prompt_lookup: dict | None = None  # {num_assistant_tokens, max_ngram_size} where prompt lookup is on

    def _read_limits(self) -> dict:
        config = json.loads((self.dir / "config.json").read_text())
        self.context_length = int(config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(config.get("vocab_size") or 0)
        return config

    @abc.abstractmethod
    def default_config(self):
        """The engine's own default GenerationConfig, which generation_config() starts from."""

    def _eos_ids(self, config: dict) -> set[int]:
        ids: set[int] = set()
        path = self.dir / "generation_config.json"
        for source in ((json.loads(path.read_text()) if path.is_file() else {}), config):
            value = source.get("eos_token_id")
            if value is not None:
                ids.update(int(v) for v in (value if isinstance(value, list) else [value]))
            if ids:
                break
        if not ids:
            ids.add(int(self.tokenizer.get_eos_token_id()))
        return ids

    # ------------------------------------------------------------ text

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text).input_ids.data[0]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(t) for t in ids])

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The model's own chat template when it has one (a conversation it refuses raises
        ChatTemplateError with its words), a plain role-tagged one otherwise. Tools go to a template
        that reads them only: for one that does not, the tokenizer would write its own long
        description of them (serve/llm/tools.py writes a compact one instead)."""
        messages = [dict(m) for m in messages]  # tool_calls and tool_call_id included
        template = self.tokenizer.chat_template or ""
        extra = {"tools": tools} if tools and "tools" in template else {}
        if not template:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, chat_template=FALLBACK_CHAT_TEMPLATE, **extra
            )
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except RuntimeError as exc:  # what the template raised (the renderer has no narrower class)
            raise template_refusal(exc) from None

    # ------------------------------------------------------------ generation

    def generation_config(self, prompt_length: int, sampling: Sampling):
        """The GenerationConfig of a request; a Sampling field it cannot carry is refused, not dropped."""
        refuse_unhonoured(sampling, ENGINE, self.honours)
        if sampling.top_logprobs > self.max_top_logprobs:
            raise UnsupportedSampling("top_logprobs", ENGINE)
        config = self.default_config()
        config.max_new_tokens = max(1, min(sampling.max_new_tokens, self.context_length - prompt_length))
        config.stop_token_ids = set(self.eos_token_ids)
        config.num_beam_groups, config.num_beams, config.num_return_sequences = 1, 1, 1
        config.repetition_penalty = sampling.repetition_penalty
        config.presence_penalty, config.frequency_penalty = sampling.presence_penalty, sampling.frequency_penalty
        config.logprobs = 1 if sampling.logprobs else 0
        config.do_sample = sampling.temperature > 0
        if config.do_sample:
            # OpenAI semantics: temperature and top_p, so top-k cuts nothing unless it is asked.
            config.temperature, config.top_p = sampling.temperature, sampling.top_p
            config.top_k, config.min_p = sampling.top_k or 2**63 - 1, sampling.min_p
            # Unseeded, a fresh seed: the pipeline's default rng_seed is one fixed number, so every
            # unseeded request of a prompt sampled the same text (and n=2 two equal choices).
            config.rng_seed = int(sampling.seed) if sampling.seed is not None else secrets.randbits(63)
        if sampling.constraint is not None:
            config.structured_output_config = self.check_constraint(sampling.constraint)
        if self.prompt_lookup:  # a prompt-lookup pipeline refuses a request that does not set both
            config.num_assistant_tokens = self.prompt_lookup["num_assistant_tokens"]
            config.max_ngram_size = self.prompt_lookup["max_ngram_size"]
        return config

    def check_constraint(self, constraint: Constraint):
        """The StructuredOutputConfig of a constraint, or UnsupportedConstraint (a ValueError) saying
        why the engine cannot take it: checked before the engine sees it (engines/openvino/structured.py)."""
        from engines.openvino.structured import structured_output_config

        return structured_output_config(self.ov_genai, constraint)

    @staticmethod
    def _tensor(ids) -> object:
        import openvino as ov

        return ov.Tensor(np.asarray([list(ids)], dtype=np.int64))


class OVGenAIRunner(OVGenAIText):
    # The Runner contract: {"input_ids": [B, T]} -> {"logits": [B, T, vocab]} (see __call__).
    input_names = ["input_ids"]
    output_names = ["logits"]

    def __init__(
        self,
        model_dir: str | Path,
        threads: int = 0,
        inference_precision: str = "f32",
        kv_cache_precision: str | None = None,
        spinning: bool = True,
        kv_cache_group_size: int = 0,
        prompt_lookup: dict | None = None,
    ):
        try:
            import openvino_genai as ov_genai
        except ImportError:
            raise RuntimeError(
                "OpenVINO GenAI artifacts need openvino-genai: pip install openvino-genai openvino-tokenizers"
            ) from None
        if inference_precision not in PRECISIONS:
            raise ValueError(f"inference_precision {inference_precision!r}: use one of {PRECISIONS}")
        self.ov_genai = ov_genai
        self.dir = Path(model_dir)
        self.inference_precision = inference_precision
        self.properties = runner_properties(
            threads, inference_precision, kv_cache_precision, spinning, kv_cache_group_size
        )
        self.prompt_lookup = prompt_lookup_settings(prompt_lookup)
        config = self._read_limits()
        check_kv_group(config, kv_cache_group_size)
        # ATTENTION_BACKEND=SDPA: the stateful model as exported (the one scoring runs), not the
        # paged-attention rewrite the pipeline may otherwise pick. Prompt lookup runs only on paged
        # attention (the pipeline refuses SDPA with it); scoring is the same IR either way.
        self._backend = {"prompt_lookup": True} if self.prompt_lookup else {"ATTENTION_BACKEND": "SDPA"}
        self._pipe = None  # the generation pipeline, compiled on first use (scoring never generates)
        self.tokenizer = ov_genai.Tokenizer(str(self.dir))  # the files the pipeline would read
        self.eos_token_ids = self._eos_ids(config)
        self._request = None  # the scoring model, compiled on first use (serve never scores)
        self._lock = threading.Lock()
        self._pipe_lock = threading.Lock()

    @property
    def pipe(self):
        """The LLMPipeline, compiled when something first generates: the race's scoring and the
        evaluation's fidelity and tasks only score, and each compiled model holds its own copy of the
        weights (at Llama-3.2-1B's shape a Q8_0 file's pipeline was most of 4 GB beside the scoring model)."""
        with self._pipe_lock:
            if self._pipe is None:
                self._pipe = self.ov_genai.LLMPipeline(str(self.dir), "CPU", **self._backend, **self.properties)
            return self._pipe

    def prepare_generation(self) -> None:
        """Compile the generation pipeline now (a server says it is ready once it can answer at once)."""
        _ = self.pipe

    def default_config(self):
        return self.pipe.get_generation_config()

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        cancelled: Callable[[], bool] = lambda: False,
        on_logprob: Callable[[TokenLogprob], None] | None = None,  # never called: logprobs are refused
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) until EOS, max_new_tokens, the context end, or cancellation.

        LLMPipeline.generate blocks until it is done, so it runs in a helper thread and its streamer
        hands tokens over a queue; closing this iterator early cancels the generation."""
        config = self.generation_config(len(prompt_ids), sampling)
        tokens: queue.Queue = queue.Queue()
        stop = threading.Event()
        errors: list[BaseException] = []
        streamer = _TokenStreamer.make(self.ov_genai, tokens.put, lambda: stop.is_set() or cancelled())

        def work():
            try:
                with self._lock:
                    self.pipe.generate(self._tensor(prompt_ids), config, streamer)
            except BaseException as exc:  # handed to the consumer
                errors.append(exc)
            finally:
                tokens.put(_DONE)

        thread = threading.Thread(target=work, name="ov-genai-generate", daemon=True)
        thread.start()
        ids: list[int] = []
        emitted = ""
        try:
            while True:
                token = tokens.get()
                if token is _DONE:
                    break
                if token in self.eos_token_ids:
                    stop.set()
                    continue
                ids.append(token)
                text = self.decode(ids)
                # Hold back an incomplete UTF-8 sequence (the decoder shows it as U+FFFD) until the
                # token that completes it arrives.
                piece = "" if text.endswith("\ufffd") else text[len(emitted) :]
                emitted += piece
                yield token, piece
                if cancelled():
                    stop.set()
        finally:
            stop.set()
            thread.join()
        if errors:
            raise errors[0]

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        """Greedy decoding of exactly `new_tokens` tokens (EOS may not end it early): perf_counter()
        after each token. The prefill runs inside this call, so [0] minus the caller's start is the time
        to first token."""
        config = self.generation_config(len(prompt_ids), Sampling(max_new_tokens=new_tokens))
        config.max_new_tokens = config.min_new_tokens = new_tokens
        config.ignore_eos = True
        config.stop_token_ids = set()
        stamps: list[float] = []
        streamer = _TokenStreamer.make(self.ov_genai, lambda _: stamps.append(time.perf_counter()), lambda: False)
        with self._lock:
            self.pipe.generate(self._tensor([int(i) for i in prompt_ids]), config, streamer)
        return stamps

    # ------------------------------------------------------------ scoring

    def _scoring_request(self):
        if self._request is None:
            import openvino as ov

            core = ov.Core()
            compiled = core.compile_model(core.read_model(str(self.dir / IR_FILE)), "CPU", self.properties)
            self._request = compiled.create_infer_request()
        return self._request

    def logits(self, ids) -> np.ndarray:
        """Logits at every position of one sequence, from an empty cache: [T, vocab]. One forward
        pass, or passes of SCORING_CHUNK_TOKENS over a quantized KV cache (the module docstring says why)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        length = ids.shape[1]
        chunk = SCORING_CHUNK_TOKENS if self.properties["KV_CACHE_PRECISION"] in QUANTIZED_KV else length
        request = self._scoring_request()
        parts = []
        with self._lock:
            request.reset_state()
            for start in range(0, length, chunk):
                self._pass(request, ids[:, start : start + chunk], start, np.zeros(1, dtype=np.int32))
                parts.append(np.array(request.get_tensor("logits").data[0]))  # a copy: the next pass overwrites it
            request.reset_state()
        return np.concatenate(parts)

    def log_likelihood(self, ids, start: int = 1) -> np.ndarray:
        """log p(token i | the tokens before it) for each i >= start (start >= 1)."""
        return token_logprobs(self.logits(ids), ids)[start - 1 :]

    def continuation_logprobs(self, context, continuations) -> list[np.ndarray]:
        """log p(each continuation's tokens | context + its earlier tokens), one array per continuation,
        with the shared context run once (engines/pytorch/runner.TorchLM's, for the same lm-eval
        adapter): the context in batch 1, then the continuations right-padded into one batch whose
        first pass gathers the context's KV cache into every row through the IR's beam_idx input (as
        beam search does). Passes of SCORING_CHUNK_TOKENS over a quantized cache, as logits() runs."""
        tails = padded_continuations(context, continuations)
        (rows, width), start_at = tails.shape, len(context)
        quantized = self.properties["KV_CACHE_PRECISION"] in QUANTIZED_KV
        chunk = SCORING_CHUNK_TOKENS if quantized else start_at + width
        request = self._scoring_request()
        with self._lock:
            request.reset_state()
            head = np.asarray(context, dtype=np.int64)[None]
            for start in range(0, start_at, chunk):
                self._pass(request, head[:, start : start + chunk], start, np.zeros(1, dtype=np.int32))
            last = np.array(request.get_tensor("logits").data[0, -1])  # predicts each continuation's first
            parts = [np.broadcast_to(last, (rows, 1, last.shape[-1]))]
            for start in range(0, width, chunk):
                beams = np.zeros(rows, dtype=np.int32) if start == 0 else np.arange(rows, dtype=np.int32)
                self._pass(request, tails[:, start : start + chunk], start_at + start, beams)
                parts.append(np.array(request.get_tensor("logits").data))
            request.reset_state()
        logits = np.concatenate(parts, axis=1)  # position j predicts tails[:, j]
        return [token_logprobs(logits[row, : len(ids)], [0, *ids]) for row, ids in enumerate(continuations)]

    @staticmethod
    def _pass(request, ids: np.ndarray, start: int, beams: np.ndarray) -> None:
        """One forward pass of `ids` ([rows, n]) at positions start..start+n over the request's state."""
        rows, length = ids.shape
        request.infer(
            {
                "input_ids": np.ascontiguousarray(ids),
                "attention_mask": np.ones((rows, start + length), dtype=np.int64),
                "position_ids": np.tile(np.arange(start, start + length, dtype=np.int64), (rows, 1)),
                "beam_idx": beams,
            },
            share_inputs=True,
        )

    def __call__(self, inputs: dict) -> dict:
        return {"logits": np.stack([self.logits(row) for row in inputs["input_ids"]]).astype(np.float32)}


def engine_settings(root: Path, engine: dict) -> tuple[Path, dict]:
    """The folder and the settings of an artifact's {"format": "openvino-genai", ...} engine block
    (precisions, KV-cache group size, prompt lookup); refuses, with the missing CPU feature named, a
    precision this CPU cannot run."""
    precision = engine.get("inference_precision", "f32")
    folder = Path(root) / engine.get("dir", ".")
    require_cpu_features(precision, what=str(folder))
    return folder, {
        "inference_precision": precision,
        "kv_cache_precision": engine.get("kv_cache_precision"),
        "kv_cache_group_size": int(engine.get("kv_cache_group_size") or 0),
        "prompt_lookup": prompt_lookup_settings(engine.get("prompt_lookup")),
    }


def load_ov_genai_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> OVGenAIRunner:
    """The Runner of an artifact's {"format": "openvino-genai", ...} engine block."""
    folder, settings = engine_settings(root, engine)
    return OVGenAIRunner(folder, threads=threads, spinning=spinning, **settings)


# mypy checks that the runner implements the generation interface (engines/generation.py).
_generator: type[ScoringGenerator] = OVGenAIRunner
