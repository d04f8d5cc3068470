"""The native GGUF engine as a Generator: a GGUF file's own blocks (engines/native_gguf/model.py),
the model's Hugging Face tokenizer (`tokenizers`) and its chat template (jinja2, sandboxed, as
transformers renders it). One sequence at a time, its prompt read 64 tokens a pass; torch-free, so
serve/ runs it directly.

An artifact's engine block reads {"format": "native-gguf", "dir": SUBDIR, "gguf": FILE, "context": N};
SUBDIR holds FILE, tokenizer.json and tokenizer_config.json (and chat_template.jinja where the model
has one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from engines.generation import (
    FALLBACK_CHAT_TEMPLATE,
    ChatTemplateError,
    Sampling,
    ScoringGenerator,
    TokenLogprob,
    refuse_unhonoured,
    token_logprobs,
    top_logprobs,
)
from engines.weights import KVShape, WeightBytes

ENGINE = "native-gguf"
# Every optional Sampling field but the constraint and n, carried out on each step's logits in numpy:
# penalties first, then the logprobs are read, then temperature, top-k, min-p and top-p.
HONOURS = ("logprobs", "top_logprobs", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MAX_TOP_LOGPROBS = 20


class NativeGGUFRunner:
    input_names = ["input_ids"]
    output_names = ["logits"]
    honours = HONOURS
    max_top_logprobs = MAX_TOP_LOGPROBS

    def __init__(self, folder: str | Path, gguf: str, context: int = 0, threads: int = 0):
        from tokenizers import Tokenizer

        from engines.native_gguf.model import NativeGGUF

        self.dir = Path(folder)
        self.model = NativeGGUF(self.dir / gguf, context=context, threads=threads)
        self.context_length = self.model.context
        self.vocab_size = self.model.hyper.vocab
        self.tokenizer = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        self.config = _json(self.dir / "tokenizer_config.json")
        self.template = _chat_template(self.dir, self.config)
        self.eos_token_ids = self._eos_ids()

    # --- text ---------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The model's own chat template where it has one (a conversation it refuses raises
        ChatTemplateError with its words), a plain role-tagged one otherwise."""
        from jinja2 import TemplateError

        special = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=True, **special)
        except TemplateError as exc:
            raise ChatTemplateError(" ".join(str(exc).split())[:300] or type(exc).__name__) from None

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        token = self.tokenizer.token_to_id(_token_text(self.config.get("eos_token")) or "")
        if token is not None:
            ids.add(int(token))
        generation = _json(self.dir / "generation_config.json").get("eos_token_id")
        ids.update(int(i) for i in (generation if isinstance(generation, list) else [generation]) if i is not None)
        return ids

    # --- generation ---------------------------------------------------------------------------------

    def _prefill(self, prompt_ids) -> np.ndarray:
        """The prompt read in passes of model.max_batch tokens: the last token's logits."""
        if not len(prompt_ids):
            raise ValueError("an empty prompt")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room in a context of {self.context_length}"
            )
        return self.model.forward(prompt_ids, 0, every=False)[-1]

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        cancelled: Callable[[], bool] = lambda: False,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) until EOS, max_new_tokens, the context end, or cancellation."""
        from engines.text_stream import HFTextStream

        refuse_unhonoured(sampling, ENGINE, HONOURS)
        rng = np.random.default_rng(sampling.seed)
        logits = self._prefill(prompt_ids)
        seen = np.zeros(self.vocab_size, np.int64)  # generated counts (presence and frequency penalties)
        in_prompt = np.zeros(self.vocab_size, bool)
        in_prompt[np.asarray(prompt_ids, np.int64)] = True
        stream = HFTextStream(self.tokenizer, skip_special_tokens=True)
        position = len(prompt_ids)
        for _ in range(sampling.max_new_tokens):
            if cancelled():
                return
            scores = penalized(logits, sampling, seen, in_prompt)
            token = choose(scores, sampling, rng)
            if token in self.eos_token_ids:
                return
            if sampling.logprobs and on_logprob is not None:
                on_logprob(top_logprobs(scores, token, sampling.top_logprobs))
            yield token, stream.decode(token)
            seen[token] += 1
            if position >= self.context_length:
                return
            logits = self.model.step(token, position)
            position += 1

    # --- what the pipeline measures -----------------------------------------------------------------

    def logits(self, ids) -> np.ndarray:
        """Logits at every position of one sequence: [T, vocab]."""
        ids = [int(i) for i in ids]
        if len(ids) > self.context_length:
            raise ValueError(f"{len(ids)} tokens do not fit a context of {self.context_length}")
        return np.array(self.model.forward(ids, 0, every=True))

    def log_likelihood(self, ids, start: int = 1) -> np.ndarray:
        return token_logprobs(self.logits(ids), ids)[start - 1 :]

    def __call__(self, inputs: dict) -> dict:
        return {"logits": np.stack([self.logits(row) for row in inputs["input_ids"]]).astype(np.float32)}

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        """Greedy decoding of exactly `new_tokens` tokens: perf_counter() after each (the prefill runs
        inside the call, so [0] minus the caller's start is the time to first token)."""
        logits = self._prefill([int(t) for t in prompt_ids])
        stamps, position = [], len(prompt_ids)
        for index in range(new_tokens):
            token = int(np.argmax(logits))
            stamps.append(time.perf_counter())
            if index + 1 < new_tokens:
                logits = self.model.step(token, position)
                position += 1
        return stamps

    def weight_bytes_per_token(self) -> WeightBytes:
        read = self.model.weight_bytes_per_token
        return WeightBytes(read, read, ["token_embd.weight"], "the native GGUF kernels' repacked blocks")

    def kv_shape(self) -> KVShape:
        h = self.model.hyper
        return KVShape(h.layers, h.kv_heads, h.head_dim, self.model.kv_bytes)


def penalized(logits: np.ndarray, sampling: Sampling, seen: np.ndarray, in_prompt: np.ndarray) -> np.ndarray:
    """The logits after the repetition penalty (Hugging Face's: over the prompt and what was generated)
    and the presence and frequency penalties (OpenAI's: over what was generated)."""
    scores = np.asarray(logits, np.float32)
    if sampling.repetition_penalty != 1.0:
        scores = scores.copy()
        hit = in_prompt | (seen > 0)
        scores[hit] = np.where(
            scores[hit] > 0, scores[hit] / sampling.repetition_penalty, scores[hit] * sampling.repetition_penalty
        )
    if sampling.presence_penalty or sampling.frequency_penalty:
        penalty = sampling.presence_penalty * (seen > 0) + sampling.frequency_penalty * seen
        scores = (scores - penalty).astype(np.float32)
    return scores


def choose(scores: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else a draw after temperature, top-k, min-p and top-p."""
    if sampling.temperature <= 0:
        return int(np.argmax(scores))
    x = scores.astype(np.float64) / sampling.temperature
    if 0 < sampling.top_k < x.size:
        x[x < np.partition(x, -sampling.top_k)[-sampling.top_k]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if sampling.min_p > 0:
        p[p < sampling.min_p * p.max()] = 0
    if sampling.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < sampling.top_p  # the smallest set reaching top_p
        p[order[~keep]] = 0
    return int(rng.choice(p.size, p=p / p.sum()))


def _json(path: Path) -> dict:
    try:
        loaded = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _token_text(value) -> str:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _chat_template(folder: Path, config: dict):
    """The model's chat template (chat_template.jinja, else tokenizer_config.json's), in a sandbox
    with what transformers gives templates (raise_exception, tojson, strftime_now)."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    file = folder / "chat_template.jinja"
    text = file.read_text() if file.is_file() else config.get("chat_template")
    if isinstance(text, list):  # several named templates: the default one
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    return environment.from_string(text if isinstance(text, str) and text else FALLBACK_CHAT_TEMPLATE)


def load_native_gguf_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> NativeGGUFRunner:
    """Runner from an engine block. `spinning` is libgomp's own policy here: its threads spin a while
    between steps, then sleep. The block's `context` goes to the model as it is: a value that is not a
    whole number of positions within bounds is refused there in one line (contract.context_positions)."""
    context = engine.get("context")
    return NativeGGUFRunner(
        Path(root) / engine.get("dir", "."), engine["gguf"], 0 if context is None else context, threads
    )


# mypy checks that the runner implements the generation interface (engines/generation.py).
_generator: type[ScoringGenerator] = NativeGGUFRunner
