"""ONNX Runtime GenAI runner for causal LMs: prompt in, tokens out, one token at a time.

A causal-LM artifact's engine block reads {"format": "onnxruntime-genai", "dir": SUBDIR, "task":
"causal_lm", ...}; SUBDIR holds genai_config.json, the ONNX decoder with its KV cache, and the
tokenizer files the GenAI builder writes. Torch-free: serve/ uses this directly.
"""

from __future__ import annotations

import json
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
    refuse_unhonoured,
    template_refusal,
    token_logprobs,
    top_logprobs,
)
from engines.hardware import usable_cores

ENGINE = "onnxruntime-genai"
# The Sampling fields its Generator carries out (the constraint through set_guidance; search options;
# logprobs read from the logits of each step, after the repetition penalty and before temperature,
# top-k and top-p). min_p and the presence and frequency penalties have no search option in
# onnxruntime-genai 0.18.
GENERATOR_HONOURS = ("constraint", "logprobs", "top_logprobs", "top_k", "repetition_penalty")
MAX_TOP_LOGPROBS = 20  # as OpenAI's API: any k fits the logits, the answer grows with it

# How a Constraint's kind is named to set_guidance (llguidance underneath; grammars are Lark).
GUIDANCE_KINDS = {"json_schema": "json_schema", "regex": "regex", "grammar": "lark_grammar"}


def guidance(constraint: Constraint) -> tuple[str, str]:
    """set_guidance's arguments for a constraint. A JSON schema is written compact: llguidance lets
    whitespace run between JSON tokens otherwise, and a model that likes a whitespace token (the tiny
    test model does) writes "{" and spaces until max_tokens."""
    value = constraint.value
    if constraint.kind == "json_schema":
        schema = json.loads(value)
        schema = closed_objects({} if schema is True else schema)
        value = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    return GUIDANCE_KINDS[constraint.kind], value


def closed_objects(node):
    """The schema with `additionalProperties: false` on each object with properties that does not
    say otherwise: the output is still valid (its properties are all allowed), and a small model
    cannot wander into writing a new key until max_tokens."""
    if isinstance(node, list):
        return [closed_objects(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: closed_objects(value) for key, value in node.items()}
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def genai_dir(root: Path, engine: dict) -> Path:
    return root / engine.get("dir", ".")


class GenAIRunner:
    # The Runner contract: {"input_ids": [B, T]} -> {"logits": [B, T, vocab]} (see __call__).
    input_names = ["input_ids"]
    output_names = ["logits"]
    honours = GENERATOR_HONOURS
    max_top_logprobs = MAX_TOP_LOGPROBS

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
        self.has_chat_template = has_chat_template(self.dir)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The model's own chat template when it has one (a conversation it refuses raises
        ChatTemplateError with its words), a plain role-tagged one otherwise."""
        payload = json.dumps(messages)
        extra = {"tools": json.dumps(tools)} if tools else {}
        if not self.has_chat_template:
            return self.tokenizer.apply_chat_template(
                payload, template_str=FALLBACK_CHAT_TEMPLATE, add_generation_prompt=True, **extra
            )
        try:
            return self.tokenizer.apply_chat_template(payload, add_generation_prompt=True, **extra)
        except RuntimeError as exc:  # what the template raised (GenAI's renderer has no narrower class)
            raise template_refusal(exc) from None

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        cancelled: Callable[[], bool] = lambda: False,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) until EOS, max_new_tokens, the context end, or cancellation;
        with sampling.logprobs, each token's TokenLogprob goes to `on_logprob` first."""
        refuse_unhonoured(sampling, ENGINE, GENERATOR_HONOURS)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(**self.search_options(len(prompt_ids), sampling))
        if sampling.constraint is not None:
            params.set_guidance(*guidance(sampling.constraint))
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(prompt_ids)
        stream = self.tokenizer.create_stream()
        produced = 0
        while produced < sampling.max_new_tokens and not generator.is_done() and not cancelled():
            # The logits the next token is chosen from, read before it is: after generate_next_token()
            # get_logits() runs the model on the new token and returns the position after it.
            logits = np.asarray(generator.get_logits()).reshape(-1) if sampling.logprobs else None
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            produced += 1
            if token in self.eos_token_ids:
                return
            if logits is not None and on_logprob is not None:
                on_logprob(top_logprobs(logits, token, sampling.top_logprobs))
            yield token, stream.decode(token)

    def check_constraint(self, constraint: Constraint) -> None:
        """Compile a constraint as a generation would (a generator of two tokens, never run); a
        ValueError carries the engine's reason when it cannot."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=2)
        params.set_guidance(*guidance(constraint))
        try:
            self.og.Generator(self.model, params)
        except Exception as exc:  # onnxruntime-genai raises a plain RuntimeError with llguidance's words
            raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None

    def search_options(self, prompt_length: int, sampling: Sampling) -> dict:
        options: dict[str, Any] = {
            "max_length": min(self.context_length, prompt_length + sampling.max_new_tokens),
            "do_sample": sampling.temperature > 0,
        }
        if sampling.repetition_penalty != 1.0:
            options["repetition_penalty"] = sampling.repetition_penalty
        if sampling.temperature > 0:
            # OpenAI semantics: temperature and top_p only, so top-k cuts nothing unless it is asked.
            top_k = sampling.top_k or self.vocab_size or 1 << 20
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=top_k)
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


# mypy checks that the runner implements the generation interface (engines/generation.py).
_generator: type[ScoringGenerator] = GenAIRunner


def has_chat_template(folder: Path) -> bool:
    """Whether the model folder carries a chat template, where onnxruntime-genai's tokenizer reads
    one: chat_template.jinja, or tokenizer_config.json's chat_template."""
    if (folder / "chat_template.jinja").is_file():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else False
    except (ValueError, AttributeError):
        return False
