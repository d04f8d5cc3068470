"""OpenVINO GenAI continuous batching for causal LMs: many generations at once, scheduled by the
engine (what serve runs when it takes several requests at once). The one-at-a-time runner, and what
both share (tokenizer, chat template, generation settings, CPU properties): engines/openvino/genai_runner.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.generation import BatchEngine, BatchSettings, Sampling, TokenLogprob
from engines.openvino.genai_runner import (
    SAMPLING_HONOURS,
    OVGenAIText,
    check_kv_group,
    engine_settings,
    head_dim,
    prompt_lookup_settings,
    runner_properties,
)
from engines.openvino.runner import PRECISIONS
from engines.text_stream import HFStreams, HFTextStream, hf_streams

# Tokens per KV-cache block of the CPU plugin's paged attention (what the continuous-batching
# pipeline allocates and frees), whatever the cache precision: measured on this OpenVINO GenAI by the
# share of blocks a sequence of known length takes (tests/engines/test_openvino_genai_kv.py).
CPU_KV_BLOCK_TOKENS = 32
KV_ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
QUANT_PARAM_BYTES = 8  # a float32 scale and zero point


def kv_block_bytes(
    config: dict, kv_precision: str, group_size: int = 0, block_tokens: int = CPU_KV_BLOCK_TOKENS
) -> int:
    """Bytes one KV-cache block takes: key and value of every layer's KV heads for block_tokens tokens,
    as the CPU plugin lays them out (checked against the engine's own kv_cache_size_in_bytes):
    f32/bf16/f16 one element per channel; u8 keys by channel (a scale and zero point per channel for
    the block) and values by token (one per group of `group_size` channels; 0: the head's width).
    A u4 block takes twice its packed size on this OpenVINO (2026.4): its data and its scales are
    allocated as if each 4-bit code took a byte, so u4 holds fewer tokens per GB than u8."""
    layers = int(config["num_hidden_layers"])
    kv_heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)
    width = head_dim(config)
    if kv_precision in KV_ELEMENT_BYTES:
        per_head = 2 * block_tokens * width * KV_ELEMENT_BYTES[kv_precision]
    else:
        groups = -(-width // (group_size or width))
        keys = block_tokens * width + QUANT_PARAM_BYTES * width
        values = block_tokens * (width + QUANT_PARAM_BYTES * groups)
        # u4: half the codes' bytes, twice everything (u8's size plus its scales once more)
        scales = QUANT_PARAM_BYTES * (width + block_tokens * groups)
        per_head = keys + values + (scales if kv_precision == "u4" else 0)
    return layers * kv_heads * per_head


def kv_bytes_per_token(config: dict, kv_precision: str, group_size: int = 0) -> float:
    """Bytes one token takes in the KV cache (a block's over its tokens: u8 keys' scales are per block)."""
    return kv_block_bytes(config, kv_precision, group_size) / CPU_KV_BLOCK_TOKENS


@dataclass
class OVRequestHandle:
    """One request in the pipeline: its GenerationHandle, and the log-probabilities of the tokens the
    last read returned (where the request asked for them)."""

    native: Any  # openvino_genai's GenerationHandle
    logprobs: bool
    last_logprobs: list[TokenLogprob] = field(default_factory=list)
    started: bool = False  # its first token (the prefill's) was read
    # With prompt lookup: the proposed tokens the last decode step accepted (its tokens less the one
    # the model makes anyway); None where that step was no speculative decode step.
    last_accepted: int | None = None

    def cancel(self) -> None:
        self.native.cancel()


class OVGenAIBatchEngine(OVGenAIText):
    """Many generations at once through OpenVINO GenAI's continuous-batching pipeline: requests are
    added with add(), the caller drives step(), and each request's handle gives back the tokens of
    that step. The engine schedules (prefill chunks beside running decodes, paged KV cache, prefix
    caching); cancelling a handle frees its KV blocks at the next step.

    The KV cache is a fixed number of blocks (num_kv_blocks, from settings.kv_cache_bytes), allocated
    at start, so what fits is known exactly: `num_blocks` blocks of `block_tokens` tokens, each
    `block_bytes` at the cache's precision (kv_block_bytes).

    With prompt lookup (the artifact's engine block, or settings.prompt_lookup) each decode step
    proposes up to num_assistant_tokens tokens that continue an n-gram of the prompt and keeps those
    the model agrees with: greedy output is the plain engine's, several tokens a step where the answer
    quotes the prompt. The pipeline does not report how many it proposed, so proposed_per_step is the
    most (num_assistant_tokens).

    Its outputs carry each generated token's log-probability and no alternatives (max_top_logprobs
    0), taken from the distribution the token was sampled from: after temperature, top-k, top-p,
    min-p and the penalties (measured: top_k=5 on the tiny random model gives about log(1/5))."""

    honours = (*SAMPLING_HONOURS, "logprobs", "top_logprobs")  # top_logprobs: up to max_top_logprobs (0)

    def __init__(
        self,
        model_dir: str | Path,
        settings: BatchSettings,
        threads: int = 0,
        inference_precision: str = "f32",
        kv_cache_precision: str | None = None,
        spinning: bool = True,
        kv_cache_group_size: int = 0,
        prompt_lookup: dict | None = None,
        tokenizer_json: Path | None = None,
    ):
        import openvino_genai as ov_genai

        if inference_precision not in PRECISIONS:
            raise ValueError(f"inference_precision {inference_precision!r}: use one of {PRECISIONS}")
        self.ov_genai = ov_genai
        self.dir = Path(model_dir)
        self.settings = settings
        properties = runner_properties(threads, inference_precision, kv_cache_precision, spinning, kv_cache_group_size)
        self.kv_cache_precision = str(properties["KV_CACHE_PRECISION"])
        self.kv_cache_group_size = kv_cache_group_size
        lookup: dict | bool | None = prompt_lookup
        if settings.prompt_lookup is not None:  # the server's --prompt-lookup / --no-prompt-lookup
            lookup = (prompt_lookup or True) if settings.prompt_lookup else None
        self.prompt_lookup = prompt_lookup_settings(lookup)
        if self.prompt_lookup:
            properties["prompt_lookup"] = True
        config = self._read_limits()
        check_kv_group(config, kv_cache_group_size)
        self.block_tokens = CPU_KV_BLOCK_TOKENS
        self.block_bytes = kv_block_bytes(config, self.kv_cache_precision, kv_cache_group_size, self.block_tokens)
        self.num_blocks = max(1, settings.kv_cache_bytes // self.block_bytes)
        scheduler = ov_genai.SchedulerConfig()
        scheduler.cache_size = 0  # sized by num_kv_blocks instead: a fixed cache, allocated once
        scheduler.num_kv_blocks = self.num_blocks
        scheduler.max_num_seqs = settings.max_num_seqs
        scheduler.max_num_batched_tokens = settings.max_batched_tokens
        scheduler.enable_prefix_caching = settings.prefix_caching
        scheduler.dynamic_split_fuse = True  # prompts prefilled in chunks beside the running decodes
        self.pipe_args = (str(self.dir), scheduler, "CPU", properties)
        self.pipe = ov_genai.ContinuousBatchingPipeline(*self.pipe_args)
        self.tokenizer = self.pipe.get_tokenizer()
        self.eos_token_ids = self._eos_ids(config)
        self.streams: HFStreams | None = None  # decode() is the engine's own while it is checked
        self.streams = hf_streams(tokenizer_json, self.decode, self._special_ids())
        # The pipeline allocates its blocks at the first step; until then it reports 0.
        self.kv_cache_bytes = self.num_blocks * self.block_bytes

    def default_config(self):
        return self.pipe.get_config()

    def _special_ids(self) -> list[int]:
        bos = int(self.tokenizer.get_bos_token_id())
        return sorted(self.eos_token_ids | ({bos} if bos >= 0 else set()))

    def decode(self, ids: list[int]) -> str:
        """The text of ids: by tokenizers where it was checked against the engine's decode (one call of
        which runs the detokenizer IR), else by that decode."""
        return self.streams.decode(ids) if self.streams is not None else super().decode(ids)

    def text_stream(self) -> HFTextStream | None:
        """A streaming detokenizer for one request where the artifact's tokenizer.json writes what
        the engine's decode writes (engines/text_stream.py); None: the service decodes with decode()."""
        return self.streams() if self.streams is not None else None

    @property
    def proposed_per_step(self) -> int:
        """Tokens prompt lookup proposes at most per decode step (0: off)."""
        return self.prompt_lookup["num_assistant_tokens"] if self.prompt_lookup else 0

    def describe(self) -> str:
        """The startup line: the scheduler's limits."""
        s = self.settings
        group = f" (value groups of {self.kv_cache_group_size})" if self.kv_cache_group_size else ""
        lookup = (
            "prompt lookup {num_assistant_tokens} tokens per step, n-grams up to {max_ngram_size}".format(
                **self.prompt_lookup
            )
            if self.prompt_lookup
            else "prompt lookup off"
        )
        return (
            f"continuous batching in OpenVINO GenAI's scheduler: up to {s.max_num_seqs} sequences, "
            f"KV cache {self.kv_cache_bytes / 2**20:.1f} MiB ({self.num_blocks} blocks of {self.block_tokens} tokens) "
            f"{self.kv_cache_precision}{group} at {self.block_bytes} bytes a block, "
            f"{s.max_batched_tokens} tokens per step, prefix caching {'on' if s.prefix_caching else 'off'}, {lookup}, "
            f"text streamed by {'tokenizers (checked against the engine)' if self.streams else 'the engine'}"
        )

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a sequence of `tokens` tokens holds at its longest (one more for the token being
        written, and with prompt lookup the tokens a step proposes beyond it)."""
        return -(-(tokens + 1 + self.proposed_per_step) // self.block_tokens)

    def add(self, request_id: int, prompt_ids: list[int], sampling: Sampling):
        """Queue a generation in the engine; returns its handle."""
        config = self.generation_config(len(prompt_ids), sampling)
        return OVRequestHandle(self.pipe.add_request(request_id, self._tensor(prompt_ids), config), sampling.logprobs)

    def step(self) -> None:
        self.pipe.step()

    def rebuild(self) -> None:
        """A fresh pipeline after a failed step (its requests are gone): the pipeline whose step()
        raised never steps again (measured: every later step fails "get_num_scheduled_tokens() == 0",
        its requests cancelled or not). The old one is released first: its KV cache is freed."""
        self.pipe = None
        self.pipe = self.ov_genai.ContinuousBatchingPipeline(*self.pipe_args)
        self.tokenizer = self.pipe.get_tokenizer()

    def has_work(self) -> bool:
        return bool(self.pipe.has_non_finished_requests())

    def cache_usage(self) -> float:
        """Fraction of the KV cache's blocks in use (0..1)."""
        return float(self.pipe.get_metrics().cache_usage) / 100.0

    def read(self, handle: OVRequestHandle) -> tuple[list[int], bool]:
        """The tokens a handle produced since the last read (EOS left out), and whether it is done."""
        new: list[int] = []
        handle.last_logprobs = []
        handle.last_accepted = None
        native = handle.native
        if native.can_read():
            for output in native.read().values():
                logprobs = list(output.generated_log_probs) if handle.logprobs else []
                generated = [int(t) for t in output.generated_ids]
                if self.prompt_lookup and generated:
                    handle.last_accepted = len(generated) - 1 if handle.started else None
                    handle.started = True
                for i, token in enumerate(generated):
                    if token not in self.eos_token_ids:
                        new.append(token)
                        if handle.logprobs:
                            handle.last_logprobs.append(TokenLogprob(token, float(logprobs[i])))
        return new, native.get_status() != self.ov_genai.GenerationStatus.RUNNING

    def read_logprobs(self, handle: OVRequestHandle) -> list[TokenLogprob]:
        return handle.last_logprobs


def load_ov_genai_batch_engine(
    root: Path, engine: dict, settings: BatchSettings, threads: int = 0, spinning: bool = True
) -> OVGenAIBatchEngine:
    """The continuous-batching engine of an {"format": "openvino-genai", ...} artifact (what serve runs
    when it takes several requests at once)."""
    folder, engine_kw = engine_settings(root, engine)
    tokenizer_dir = Path(root) / engine["tokenizer"] if engine.get("tokenizer") else folder
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    return OVGenAIBatchEngine(folder, settings, threads, spinning=spinning, tokenizer_json=tokenizer_json, **engine_kw)


# mypy checks that the engine implements the generation interface (engines/generation.py).
_batch_engine: type[BatchEngine] = OVGenAIBatchEngine
