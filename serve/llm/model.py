"""Causal LMs: the served model around a generating engine (engines/generation.py) — the prompt a
request becomes, its limits (prompt length, token budget, KV-cache fit), its sampling settings.

Two ways to generate, chosen by --max-num-seqs and the format's row in engines/formats.py:

- Above 1 (the default), for a format that batches: the engine's own scheduler, one engine for all
  requests, driven by one scheduling thread (serve/llm/batching.py). OpenVINO GenAI artifacts run its
  continuous-batching pipeline: requests join and leave the running batch at every step, the KV cache
  is paged and its size bounds admission. ONNX Runtime GenAI artifacts run its Engine, which on a CPU
  model batches statically: up to 4 requests start together and the next batch starts when that one
  has ended (engines.onnxruntime_genai.batch.GenAIBatchEngine says why).
- 1, or a format that does not batch: one generation at a time in a dedicated thread, through the
  runner the pipeline measured (serve/llm/service.py).

Either way each token is handed to the event loop as it is produced, which is what makes
`stream: true` real streaming, and requests wait in a bounded queue: a full queue answers 429 at once.
Stop strings: serve/llm/stops.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from serve.errors import bad_request
from serve.llm.request import GenerationRequest

if TYPE_CHECKING:
    from engines.generation import BatchEngine, BatchSettings, Generator, Sampling, TextModel
    from serve.config import ServeConfig


# A temperature or a top_p below this samples as greedy decoding does: top_p 0 (which OpenAI's API
# takes) keeps only the most likely token, and a temperature of 1e-300 divides the logits into
# infinities; the engines refuse both (each is 0 in float32). vLLM's threshold. min_p 1, which OpenVINO
# GenAI refuses, is greedy decoding too.
GREEDY_BELOW = 1e-5


class GenerativeModel:
    task = "causal_lm"
    ANSWERS: ClassVar[frozenset[str]] = frozenset({"completions"})
    USE: ClassVar[str] = "a causal LM: use /v1/completions or /v1/chat/completions"

    @classmethod
    def load(cls, root: Path, engine: dict, config: ServeConfig) -> GenerativeModel:
        return cls(
            root, engine, config.ort_threads(), config.max_prompt_tokens, config.max_tokens, batch_settings(config)
        )

    def __init__(
        self,
        root: Path,
        engine: dict,
        threads: int = 0,
        max_prompt_tokens: int = 0,
        max_tokens: int = 512,
        batch: BatchSettings | None = None,  # None: one at a time
    ):
        from engines import formats, load_engine
        from engines.generation import Generator

        self.format = str(engine.get("format"))
        row = formats.get(self.format)
        self.seed_range = row.seed_range
        wants_batch = batch is not None and batch.max_num_seqs > 1
        # "continuous", "static" or "none" (one generation at a time), as the format's row says.
        self.batching = row.batching if wants_batch else "none"
        self.generator: Generator | None = None
        self.batch_engine: BatchEngine | None = None
        self.runner: TextModel
        if self.batching != "none":
            # Only the batching engine is loaded (for OpenVINO GenAI: not LLMPipeline too). Its threads
            # must not spin: they would take the event loop's cores.
            self.batch_engine = self.runner = row.load_batch_engine(
                root, engine, batch, threads=threads, spinning=False
            )
        else:
            runner = load_engine(root, engine, threads=threads)
            if not isinstance(runner, Generator):
                raise ValueError(f"engine format {self.format!r} loads a runner that does not generate")
            # A runner that compiles its generation on first use (OpenVINO GenAI's, whose scoring never
            # needs it) compiles it now: ready means the first request is answered at once.
            prepare = getattr(runner, "prepare_generation", None)
            if prepare is not None:
                prepare()
            self.generator = self.runner = runner
        self.context_length = self.runner.context_length
        self.max_prompt_tokens = min(max_prompt_tokens or self.context_length - 1, self.context_length - 1)
        self.max_tokens = max_tokens
        # Tokens the KV cache holds at most (batching): a request must fit it on its own.
        cache = self.batch_engine
        self.cache_tokens = cache.num_blocks * cache.block_tokens if cache is not None else 0
        from serve.llm.tools import takes_tools

        self.template_takes_tools = takes_tools(self.runner)
        # One thread tokenizes requests, off the event loop; one, as the loop was: the engine's
        # tokenizer is then used by it and the engine's own thread only.
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="serve-tokenize")

    def describe(self) -> str:
        """How generations are run, for the startup line."""
        from serve.llm.tools import FALLBACK

        engine = self.batch_engine
        how = engine.describe() if engine is not None else "one generation at a time (--max-num-seqs 1)"
        tools = "the model's chat template renders tools" if self.template_takes_tools else FALLBACK
        return f"{how}; {tools}"

    async def prepare_off_loop(self, request: GenerationRequest) -> tuple[list[int], Sampling]:
        """prepare() in the tokenizing thread, after the cheap length check: a long prompt is refused
        before it is tokenized, and tokenizing (or rendering a chat template) never holds the event
        loop, so running streams and health checks go on meanwhile."""
        import asyncio

        self.check_characters(request)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, self.prepare, request)

    def check_characters(self, request: GenerationRequest) -> None:
        """400 for a prompt longer in characters than max_prompt_tokens tokens can be (serve/body.py's
        MAX_CHARS_PER_TOKEN), counted without tokenizing."""
        from serve.body import MAX_CHARS_PER_TOKEN

        if request.prompt is not None:
            length = len(request.prompt)
        else:
            length = sum(len(m["content"]) + len(str(m.get("tool_calls") or "")) for m in request.messages or ())
        limit = self.max_prompt_tokens * MAX_CHARS_PER_TOKEN
        if length > limit:
            raise bad_request(
                f"the prompt has {length} characters, more than {self.max_prompt_tokens} tokens (this server's "
                f"limit) can hold: at most {limit} are tokenized",
                param="messages" if request.messages is not None else "prompt",
            )

    def prepare(self, request: GenerationRequest) -> tuple[list[int], Sampling]:
        """What the engine is handed for a request: its prompt's token ids and its sampling settings,
        every limit checked (each refusal a 400 naming the parameter)."""
        self.check_characters(request)
        prompt_ids = self.prompt_ids(request)
        budget = self.token_budget(len(prompt_ids), request.max_tokens)
        return prompt_ids, self.sampling(request, budget)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            from serve.llm.tools import chat_prompt

            text = refused_by_template(
                chat_prompt, self.runner, request.messages, request.tools, self.template_takes_tools
            )
            ids = self.runner.encode(text)
        elif request.prompt is not None:
            ids = self.runner.encode(request.prompt)
        else:
            ids = list(request.prompt_ids or [])
            vocab = self.runner.vocab_size
            if vocab and not all(0 <= t < vocab for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens}", param="prompt"
            )
        return ids

    def token_budget(self, prompt_length: int, requested: int | None) -> int:
        """New tokens allowed: the request's max_tokens within the server cap and the context."""
        room = self.context_length - prompt_length
        if requested is not None and requested > self.max_tokens:
            raise bad_request(
                f"max_tokens {requested} exceeds this server's limit of {self.max_tokens}", param="max_tokens"
            )
        if requested is not None and requested > room:
            raise bad_request(
                f"prompt ({prompt_length} tokens) + max_tokens ({requested}) exceeds the "
                f"context length of {self.context_length}",
                param="max_tokens",
            )
        if self.cache_tokens and requested is not None:
            self.check_fits(prompt_length, requested)
        budget = min(requested or self.max_tokens, room)
        if self.cache_tokens and requested is None:  # no max_tokens asked: as many as the cache holds
            budget = min(budget, self.cache_tokens - 1 - prompt_length)
            self.check_fits(prompt_length, max(budget, 1))
        return budget

    def check_fits(self, prompt_length: int, new_tokens: int) -> None:
        """A request whose prompt and new tokens cannot fit the whole KV cache can never run: 400."""
        cache = self.batch_engine
        assert cache is not None  # only a batching engine has a KV cache to fit
        needed = cache.blocks_for(prompt_length + new_tokens)
        if needed <= cache.num_blocks:
            return
        asked = f"prompt ({prompt_length} tokens) + max_tokens ({new_tokens})"
        if cache.block_tokens == 1:  # a cache counted in tokens (ONNX Runtime GenAI's static batches)
            raise bad_request(
                f"{asked} need {needed} tokens of KV cache; this server's holds {self.cache_tokens} (--kv-cache-gb)",
                param="max_tokens",
            )
        raise bad_request(
            f"{asked} need {needed} KV-cache blocks of {cache.block_tokens} tokens; this server's KV cache "
            f"holds {cache.num_blocks} ({self.cache_tokens} tokens, --kv-cache-gb)",
            param="max_tokens",
        )

    def sampling(self, request: GenerationRequest, budget: int) -> Sampling:
        """The engine's sampling settings; a seed outside the range the engine takes is a 400."""
        from engines.generation import Sampling

        low, high = self.seed_range
        if request.seed is not None and not low <= request.seed <= high:
            raise bad_request(
                f"'seed' must be between {low} and {high} for this model, got {request.seed}", param="seed"
            )
        if request.constraint is not None:
            self.check_constraint(request)
        temperature, top_p = request.temperature, request.top_p
        # Each means "the most likely token" (min_p 1 keeps only tokens as likely as the best).
        if temperature < GREEDY_BELOW or top_p < GREEDY_BELOW or request.min_p >= 1:
            temperature, top_p = 0.0, 1.0
        sampling = Sampling(
            budget,
            temperature,
            top_p,
            request.seed,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            top_k=request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            constraint=request.constraint,
        )
        self.refuse_unhonoured(sampling, request)
        return sampling

    def refuse_unhonoured(self, sampling: Sampling, request: GenerationRequest) -> None:
        """400 naming the request field of a Sampling field this engine does not honour (as the
        engine declares it: `honours`, `max_top_logprobs`; serve/llm/fields.py tabulates them)."""
        from serve.llm.fields import PARAM_OF_SAMPLING

        chat = request.messages is not None
        honours = getattr(self.runner, "honours", ())
        for name in sampling.asked():
            param = "logprobs" if name == "top_logprobs" and not chat else PARAM_OF_SAMPLING.get(name, name)
            if name == "constraint":  # asked by response_format, structured_outputs or a forced tool call
                param = request.constraint_param
            if name not in honours:
                raise bad_request(f"{param!r} is not supported by {self.engine_mode()}", param=param)
        limit = getattr(self.runner, "max_top_logprobs", 0)
        if sampling.top_logprobs > limit:
            param = "top_logprobs" if chat else "logprobs"
            raise bad_request(
                f"{self.engine_mode()} gives at most {limit} alternatives per token; {param!r} asked "
                f"{sampling.top_logprobs}",
                param=param,
            )

    def engine_mode(self) -> str:
        """The engine as a refusal names it: its format, and how it is run."""
        how = f"{self.batching} batching" if self.batching != "none" else "one generation at a time (--max-num-seqs 1)"
        return f"{self.format} with {how}"

    def check_constraint(self, request: GenerationRequest) -> None:
        """The engine compiles (or checks) the request's constraint before it is queued: what it
        cannot take is a 400 with its reason, never a failed stream or a failed batch."""
        check = getattr(self.runner, "check_constraint", None)
        if check is None:
            raise bad_request(f"{self.format} cannot constrain its output", param=request.constraint_param)
        try:
            check(request.constraint)
        except ValueError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            message = f"{self.format} cannot take this constraint: {reason}"
            raise bad_request(message, param=request.constraint_param) from None


def refused_by_template(render, *args) -> str:
    """The prompt text `render(*args)` makes of a conversation; one the model's chat template refuses
    (it raised) is a 400 with the template's words, never the fallback template's rendering."""
    from engines.generation import ChatTemplateError

    try:
        return render(*args)
    except ChatTemplateError as exc:
        raise bad_request(f"the model's chat template refuses this conversation: {exc}", param="messages") from None


def batch_settings(config: ServeConfig) -> BatchSettings:
    """The batching engine's limits from the server settings."""
    from engines.generation import BatchSettings

    return BatchSettings(
        max_num_seqs=config.max_num_seqs,
        kv_cache_bytes=int(config.kv_cache_gb * 2**30),
        max_batched_tokens=config.max_batched_tokens,
        prefix_caching=config.prefix_caching,
        prompt_lookup=config.prompt_lookup,
    )
