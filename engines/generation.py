"""The generation interface: what serve/ and the pipeline's causal-LM evaluation ask of a generating
engine, written down as Protocols, and the settings values they pass it.

- `Generator`: one generation at a time (text in and out, a chat prompt, tokens streamed from a
  prompt under a `Sampling`). What serve runs with --max-num-seqs 1, and all a new engine must be.
- `ScoringGenerator`: a Generator the pipeline also measures (logits, log-likelihoods, timed
  decoding; the roofline reads `weight_bytes_per_token()` and `kv_shape()` where an engine has them).
- `BatchEngine`: many generations at once, scheduled by the engine; serve/llm/batching.py drives it
  (add a request, step, read each request's new tokens, cancel through its handle).

Which of these a format provides, and how serve batches it, is its row in engines/formats.py.
Torch-free and runtime-free: every engine imports this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Literal, Protocol, runtime_checkable

import numpy as np

from engines.runners import TensorRunner

# Used when the model folder carries no chat template: plain role-tagged turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match: a JSON schema (as JSON text), a regular expression, or a
    grammar (EBNF / Lark text, as the engine that takes it reads it)."""

    kind: Literal["json_schema", "regex", "grammar"]
    value: str


@dataclass
class Sampling:
    """How one request samples. Every field past `seed` defaults to "none asked"; an engine that
    cannot honour one that is set refuses the request (`refuse_unhonoured`), never ignores it."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    constraint: Constraint | None = None
    logprobs: bool = False  # the log-probability of each generated token
    top_logprobs: int = 0  # ... and of this many most likely tokens at each position
    n: int = 1  # sequences generated from the prompt
    top_k: int = 0  # sample from the k most likely tokens only; 0: no cut
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # divide the logits of tokens already seen (prompt too); 1: none
    presence_penalty: float = 0.0  # subtract from the logits of tokens generated at least once
    frequency_penalty: float = 0.0  # ... this times the number of times each was generated

    def asked(self) -> list[str]:
        """The optional fields this request sets (those not at their "none" default)."""
        return [f.name for f in fields(self) if f.name in OPTIONAL_SAMPLING and getattr(self, f.name) != f.default]


OPTIONAL_SAMPLING = (
    "constraint",
    "logprobs",
    "top_logprobs",
    "n",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one generated token, and the most likely tokens at its position (most
    likely first, as many as Sampling.top_logprobs asked and the engine gives)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def top_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """A TokenLogprob from one position's logits [vocab]: the token's log softmax and the k best."""
    logp = log_softmax(np.asarray(logits).reshape(1, -1))[0]
    best = np.argsort(-logp, kind="stable")[:k]
    return TokenLogprob(token, float(logp[token]), tuple((int(i), float(logp[i])) for i in best))


class ChatTemplateError(ValueError):
    """The model's own chat template refused a conversation (it raised: a Mistral-style template that
    needs alternating roles calls raise_exception). The message is the template's own."""


def template_refusal(exc: Exception) -> ChatTemplateError:
    """The template's words out of the error an engine's C++ template renderer (minja, in both
    onnxruntime-genai and openvino-genai) raises as a RuntimeError: its message runs to " at row N,
    column M:" followed by the template text; OpenVINO puts its advice first and the message after
    "Minja's error: "."""
    text = str(exc)
    text = text.split("Minja's error:", 1)[-1]
    text = re.split(r" at row \d+, column \d+:", text, maxsplit=1)[0]
    return ChatTemplateError(" ".join(text.split())[:300] or type(exc).__name__)


class UnsupportedSampling(ValueError):
    """A Sampling field the engine cannot honour; `field` names it."""

    def __init__(self, field: str, engine: str):
        super().__init__(f"{engine} cannot honour Sampling.{field}; leave it at its default")
        self.field = field


# An engine says what it honours with two class attributes, which serve reads before it submits a
# request (and serve/llm/fields.py for the field table), an engine without them honouring none:
#   honours: tuple[str, ...]  -- the OPTIONAL_SAMPLING fields it carries out
#   max_top_logprobs: int     -- the most alternatives per position it gives (Sampling.top_logprobs)


def refuse_unhonoured(sampling: Sampling, engine: str, honours: tuple[str, ...] = ()) -> None:
    """Raise UnsupportedSampling for the first optional field `sampling` sets that `honours` lacks."""
    for name in sampling.asked():
        if name not in honours:
            raise UnsupportedSampling(name, engine)


@dataclass
class BatchSettings:
    """The batch scheduler's limits (serve's --max-num-seqs, --kv-cache-gb, ...)."""

    max_num_seqs: int = 16
    kv_cache_bytes: int = 1 << 30
    max_batched_tokens: int = 512
    prefix_caching: bool = True
    prompt_lookup: bool | None = None  # n-gram speculation where the engine has it; None: as the artifact says


def greedy_ids(runner, prompt_ids, new_tokens: int) -> list[int]:
    """Greedy continuation token ids from any runner: its own `greedy` where it has one, else its
    generation with default (greedy) sampling."""
    if hasattr(runner, "greedy"):
        return runner.greedy(prompt_ids, new_tokens)
    return [t for t, _ in runner.generate([int(i) for i in prompt_ids], Sampling(max_new_tokens=new_tokens))]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log softmax in float64 (float32 loses digits in perplexity over long texts)."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, ids) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, read from logits[i-1] (logits shaped [T, vocab])."""
    ids = np.asarray(ids, dtype=np.int64)
    logp = log_softmax(logits[: len(ids) - 1])
    return logp[np.arange(len(ids) - 1), ids[1:]]


def padded_continuations(context, continuations) -> np.ndarray:
    """The continuations right-padded (with 0) into one [rows, longest] int64 batch, for scoring them
    after a shared context (the runners' continuation_logprobs); refuses an empty context or choice."""
    if not len(context) or not continuations or not all(len(c) for c in continuations):
        raise ValueError("continuation_logprobs needs a context and non-empty continuations")
    batch = np.zeros((len(continuations), max(len(c) for c in continuations)), dtype=np.int64)
    for row, ids in enumerate(continuations):
        batch[row, : len(ids)] = ids
    return batch


# --- the Protocols -----------------------------------------------------------------------------------
# Limits are read-only properties here so that a plain attribute set in __init__ satisfies them.


class TextModel(Protocol):
    """The tokenizer side every generating engine has, and the model's limits."""

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...  # 0 when unknown (token-id prompts are then not range-checked)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text of a conversation, by the model's chat template (tools rendered by it)."""
        ...


@runtime_checkable  # serve checks that a generating format's runner is one (isinstance)
class Generator(TextModel, Protocol):
    """One generation at a time."""

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        cancelled: Callable[[], bool] = ...,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) until EOS, max_new_tokens, the context end, or `cancelled()`.
        With Sampling.logprobs (where the engine honours it), `on_logprob` is called with each
        token's TokenLogprob before the token is yielded."""
        ...


class GeneratingRunner(TensorRunner, Generator, Protocol):
    """What a generating format's loader returns (engines.load_engine): a TensorRunner over
    {"input_ids"} -> {"logits"} that also generates."""


class ScoringGenerator(Generator, Protocol):
    """A Generator the pipeline measures (optimize/evaluate/generation.py, optimize/tasks/lm_harness.py)."""

    def logits(self, ids) -> np.ndarray: ...

    def log_likelihood(self, ids, start: int = 1) -> np.ndarray: ...

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        """Greedy decoding of exactly `new_tokens` tokens: perf_counter() after each."""
        ...


class BatchHandle(Protocol):
    """One request inside a BatchEngine."""

    def cancel(self) -> None:
        """End the request at the engine's next step, which frees what it holds."""
        ...


class BatchEngine(TextModel, Protocol):
    """Many generations at once. The caller adds requests, drives step() from one thread, and reads
    each request's tokens through its handle. The KV cache is `num_blocks` blocks of `block_tokens`
    tokens (`kv_cache_bytes` in all); admission in serve/llm/batching.py counts in those blocks."""

    @property
    def settings(self) -> BatchSettings: ...  # what the engine honours of the settings it was given

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_tokens(self) -> int: ...

    @property
    def kv_cache_bytes(self) -> int: ...

    def describe(self) -> str:
        """How it batches, for the server's startup line."""
        ...

    def blocks_for(self, tokens: int) -> int:
        """KV blocks one sequence of `tokens` tokens holds at its longest."""
        ...

    def add(self, request_id: int, prompt_ids: list[int], sampling: Sampling) -> BatchHandle: ...

    def step(self) -> None: ...

    def has_work(self) -> bool: ...

    def cache_usage(self) -> float:
        """Fraction of the KV cache in use (0..1), as of the last step."""
        ...

    def read(self, handle: Any) -> tuple[list[int], bool]:
        """The tokens `handle` produced since the last read (EOS left out), and whether it is done."""
        ...

    def read_logprobs(self, handle: Any) -> list[TokenLogprob]:
        """The TokenLogprobs of the tokens the last read(handle) returned, one each, for a request
        that asked for them (Sampling.logprobs, where the engine honours it); else []."""
        ...


class StaticBatchEngine(BatchEngine, Protocol):
    """A BatchEngine that batches statically (its format's row says `batching="static"`): a batch
    takes no request once it runs, so serve admits the next one only when the engine holds none."""

    @property
    def gather_s(self) -> float: ...  # how long an idle engine may wait for more requests

    @property
    def in_flight(self) -> int: ...  # requests whose turn has not ended

    def runs_alone(self, sampling: Sampling) -> bool:
        """Whether a request needs a batch of its own."""
        ...

    def batch_blocks(self, blocks: list[int]) -> int:
        """KV blocks a batch of sequences of these sizes allocates."""
        ...


# The loaders a format row names (engines/formats.py).
GeneratorLoader = Callable[..., Generator]  # (root, engine block, threads=, spinning=)
BatchEngineLoader = Callable[..., BatchEngine]  # (root, engine block, BatchSettings, threads=, spinning=)
