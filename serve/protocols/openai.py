"""OpenAI-compatible endpoints and their parsers: /v1/models, /v1/embeddings, /v1/completions and
/v1/chat/completions.

Request and response shapes follow the OpenAI API reference, so the official `openai` client works
unchanged (it asks for base64 embeddings by default; both encodings are served). Streaming is
server-sent events: one `data: {chunk}` per generated piece, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, MutableMapping

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from serve.body import arriving, read_body
from serve.encoder.model import EncoderModel, run_encoder
from serve.errors import HTTPError, bad_request, openai_error_body, timed_out
from serve.llm.events import End, Failed, Generation, GenerationQueue
from serve.llm.fields import CHAT, COMPLETIONS, refuse_unserved_fields
from serve.llm.model import GenerativeModel
from serve.llm.request import GenerationRequest
from serve.protocols.jsonbody import FastJSONResponse, array
from serve.protocols.openapi import OPENAI_ERRORS, SCHEMAS, errors, json_body, path_param, ref
from serve.protocols.parsing import get_bool, get_int, get_number, get_object, get_str, is_int, json_object
from serve.protocols.spec import ProtocolSpec
from serve.state import STREAM_FAILED, state_of

if TYPE_CHECKING:
    from engines.generation import Sampling
    from serve.llm.stops import StopMatcher
    from serve.llm.tools import ToolCallStream


def routes() -> list[Route]:
    return [
        Route("/v1/models", list_models),
        Route("/v1/models/{model}", get_model),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


def model_card(state) -> dict:
    return {"id": state.name, "object": "model", "created": state.created, "owned_by": "serve"}


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [model_card(state_of(request))]})


async def get_model(request: Request) -> JSONResponse:
    state = state_of(request)
    check_model(state, request.path_params["model"])
    return JSONResponse(model_card(state))


def check_model(state, name: str, protocol: str | None = None) -> None:
    """404 for another model's name; with a protocol, 400 where the served model does not answer it."""
    if name != state.name:
        raise HTTPError(
            404,
            f"the model {name!r} does not exist; this server serves {state.name!r}",
            "not_found_error",
            param="model",
        )
    if protocol:
        state.require_answers(protocol, param="model")


async def read_json(request: Request, state) -> dict:
    return json_object(await read_body(request, state.config.max_request_bytes))


# --- parsing an embeddings request ----------------------------------------------------------------


@dataclass
class EmbeddingsRequest:
    model: str
    texts: list[str] | None = None  # either texts ...
    token_ids: list[list[int]] | None = None  # ... or token arrays
    encoding_format: str = "float"
    dimensions: int | None = None

    @property
    def count(self) -> int:
        return len(self.texts) if self.texts is not None else len(self.token_ids or [])


def parse_embeddings_request(data: dict, max_inputs: int) -> EmbeddingsRequest:
    model = get_str(data, "model", required=True)
    raw = data.get("input")
    request = EmbeddingsRequest(
        model=model,
        encoding_format=get_str(data, "encoding_format", "float"),
        dimensions=get_int(data, "dimensions", low=1),
    )
    get_str(data, "user")  # accepted and unused, but it must be what the API says it is
    if request.encoding_format not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    if isinstance(raw, str):
        request.texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        request.texts = raw
    elif isinstance(raw, list) and raw and all(is_int(x) for x in raw):
        request.token_ids = [raw]
    elif isinstance(raw, list) and raw and all(is_token_list(x) for x in raw):
        request.token_ids = raw
    else:
        raise bad_request("'input' must be a string, a non-empty list of strings, or token arrays", param="input")
    if request.count > max_inputs:
        raise bad_request(f"'input' has {request.count} items; at most {max_inputs} per request", param="input")
    return request


def is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(x) for x in value)


# --- parsing completion and chat requests ---------------------------------------------------------


MAX_CHOICES = 16  # `n`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on `top_logprobs`
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_sampling(data: dict, request: GenerationRequest, max_tokens_key: str = "max_tokens") -> None:
    request.max_tokens = get_int(data, max_tokens_key, request.max_tokens, low=1)
    request.temperature = get_number(data, "temperature", 1.0, 0.0, 2.0)
    request.top_p = get_number(data, "top_p", 1.0, 0.0, 1.0)
    request.stream = get_bool(data, "stream")
    request.seed = get_int(data, "seed")
    request.stop = parse_stop(data.get("stop"))
    options = get_object(data, "stream_options")
    request.include_usage = get_bool(options, "include_usage")
    if set(options) - {"include_usage"}:
        raise bad_request("'stream_options' takes 'include_usage' only", param="stream_options")
    request.n = get_int(data, "n", low=1, high=MAX_CHOICES) or 1
    request.top_k = max(get_int(data, "top_k", low=-1) or 0, 0)  # vLLM's -1, like 0: no cut
    request.min_p = get_number(data, "min_p", 0.0, 0.0, 1.0)
    request.repetition_penalty = get_number(data, "repetition_penalty", 1.0, 0.01, 10.0)
    request.presence_penalty = get_number(data, "presence_penalty", 0.0, -2.0, 2.0)
    request.frequency_penalty = get_number(data, "frequency_penalty", 0.0, -2.0, 2.0)


def parse_chat_logprobs(data: dict, request: GenerationRequest) -> None:
    """Chat: `logprobs: true`, and `top_logprobs: k` alternatives, which need it."""
    request.logprobs = get_bool(data, "logprobs")
    top = get_int(data, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    # As OpenAI's API: any top_logprobs, 0 included, needs logprobs (0 without it would ask nothing).
    if top is not None and not request.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    request.top_logprobs = top or 0


def parse_completion_logprobs(data: dict, request: GenerationRequest) -> None:
    """Completions (the legacy API): `logprobs: k` asks for the chosen token's and k alternatives."""
    k = get_int(data, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    request.logprobs, request.top_logprobs = k is not None, k or 0


def parse_stop(raw) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return stops


def parse_completion_request(data: dict) -> GenerationRequest:
    refuse_unserved_fields(data, COMPLETIONS)
    request = GenerationRequest(model=get_str(data, "model", required=True), max_tokens=16)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one: the shape some clients always send
    if isinstance(prompt, str):
        request.prompt = prompt
    elif is_token_list(prompt):
        request.prompt_ids = prompt
    else:
        raise bad_request("'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
    parse_sampling(data, request)
    parse_completion_logprobs(data, request)
    parse_structured(data, request)
    return request


def parse_structured(data: dict, request: GenerationRequest, chat: bool = False) -> None:
    """response_format / structured_outputs, and on chat tools / tool_choice: the constraint the
    output is decoded under (a forced tool call's, or the response format's)."""
    from serve.llm.structured import parse_response_format
    from serve.llm.tools import call_constraint, parse_tools

    request.constraint = parse_response_format(data)
    if data.get("structured_outputs") is not None:
        request.constraint_param = "structured_outputs"
    if not chat:
        for key in ("tools", "tool_choice"):
            if data.get(key) is not None:
                raise bad_request(f"'{key}' is taken on /v1/chat/completions only", param=key)
        return
    request.tools = parse_tools(data)
    if request.tools is not None and request.tools.forced:
        if request.constraint is not None:
            raise bad_request(
                f"'{request.constraint_param}' and a forced tool call both constrain the output: give one",
                param="tool_choice",
            )
        request.constraint, request.constraint_param = call_constraint(request.tools), "tools"


def parse_chat_request(data: dict) -> GenerationRequest:
    refuse_unserved_fields(data, CHAT)
    request = GenerationRequest(model=get_str(data, "model", required=True))
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    request.messages = [parse_message(m, i) for i, m in enumerate(raw)]
    key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    parse_sampling(data, request, key)
    parse_chat_logprobs(data, request)
    parse_structured(data, request, chat=True)
    return request


def parse_message(raw, index: int) -> dict:
    if not isinstance(raw, dict):
        raise bad_request(f"messages[{index}] must be an object", param="messages")
    role = raw.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}", param="messages")
    from serve.llm.tools import history_fields

    return {"role": role, "content": message_text(raw.get("content"), index), **history_fields(raw, index)}


def message_text(content, index: int) -> str:
    """Plain text of a message: a string, or a list of text parts (the only modality served)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", param="messages")


# --- embeddings ----------------------------------------------------------------------------------


async def embeddings(request: Request) -> FastJSONResponse:
    state = state_of(request)
    with arriving(state.batcher):
        parsed = parse_embeddings_request(await read_json(request, state), state.config.max_inputs)
        check_model(state, parsed.model, "embeddings")
        model = state.ready_model(EncoderModel)
        if parsed.dimensions is not None and parsed.dimensions != model.embedding_dim:
            raise bad_request(
                f"this model's embeddings have {model.embedding_dim} dimensions; 'dimensions' cannot change that",
                param="dimensions",
            )
        # Tokenizing in a worker thread: the event loop goes on serving meanwhile.
        if parsed.texts is not None:
            item = await asyncio.to_thread(model.from_texts, parsed.texts)
        else:
            assert parsed.token_ids is not None  # the parser sets texts or token ids
            item = model.from_token_ids(parsed.token_ids)
    tokens = int(item.inputs["attention_mask"].sum())
    state.metrics.prompt_tokens.inc(tokens)
    vectors = (await run_encoder(state, item))["sentence_embedding"]
    return FastJSONResponse(
        {
            "object": "list",
            "model": state.name,
            "data": [
                {"object": "embedding", "index": i, "embedding": encode_vector(v, parsed.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def encode_vector(vector: np.ndarray, encoding: str):
    """base64 of little-endian float32 (what the OpenAI client decodes), else a float32 array
    that the JSON writer puts out as numbers without a Python float per value."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return array(vector.astype(np.float32, copy=False))


# --- completions and chat ------------------------------------------------------------------------


async def completions(request: Request):
    return await generate(request, parse_completion_request, chat=False)


async def chat_completions(request: Request):
    return await generate(request, parse_chat_request, chat=True)


async def generate(request: Request, parse, chat: bool):
    from serve.llm.stops import StopMatcher

    state = state_of(request)
    # Counted while read and tokenized, for an engine that forms batches (ContinuousBatchingService),
    # and no longer once submitted.
    with arriving(state.generator):
        parsed = parse(await read_json(request, state))
        check_model(state, parsed.model, "completions")
        model = state.ready_model(GenerativeModel)
        prompt_ids, sampling = await model.prepare_off_loop(parsed)
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    generations = submit_choices(state.generation_queue(), prompt_ids, sampling, parsed.n, model.seed_range)
    choices = [Choice(i, g, StopMatcher(parsed.stop), tool_calls(parsed)) for i, g in enumerate(generations)]
    reply = Reply(state.name, chat, len(prompt_ids), choices, request.scope, sampling.logprobs)
    if parsed.stream:
        return await reply.stream(state.config.timeout_s, parsed.include_usage)
    return await reply.whole(state.config.timeout_s)


def tool_calls(parsed):
    """A choice's tool-call reader (serve/llm/tools.py), for a chat request whose tools are active."""
    if parsed.tools is None or not parsed.tools.active:
        return None
    from serve.llm.tools import ToolCallStream

    return ToolCallStream(parsed.tools)


def submit_choices(
    service: GenerationQueue, prompt_ids: list[int], sampling: Sampling, n: int, seed_range: tuple[int, int]
) -> list[Generation]:
    """`n` independent generations of one prompt, each its own request to the engine's scheduler
    (batched together where the engine batches); choice i of a seeded request takes seed + i (wrapped
    into the engine's range), so the choices differ and the reply is reproducible. A refusal on the
    way (a full queue) cancels those already submitted."""
    from dataclasses import replace

    low, high = seed_range
    generations = []
    try:
        for i in range(n):
            seed = None if sampling.seed is None else low + (sampling.seed - low + i) % (high - low + 1)
            generations.append(service.submit(prompt_ids, replace(sampling, seed=seed)))
    except HTTPError:
        for generation in generations:
            generation.cancel.set()
        raise
    return generations


class Choice:
    """One generation of a reply: its events read as text pieces (stop strings applied) and the
    logprob entries that came with them; with tools, the calls its text holds (`calls`)."""

    def __init__(self, index: int, generation: Generation, stops: StopMatcher, calls: ToolCallStream | None = None):
        self.index, self.generation, self.stops = index, generation, stops
        self.calls = calls  # the tool calls its text holds, where the request's tools are active
        self.finish_reason: str | None = None
        self.entries: list[dict] = []  # logprob entries, where the request asked for them
        self.text_length = 0  # characters of text handed out so far (the legacy text_offset)

    async def pieces(self):
        """(text, logprob entries since the last piece); sets finish_reason at the end."""
        fresh: list[dict] = []
        while True:
            event = await self.generation.events.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, End):
                tail = self.stops.flush()
                if tail or fresh:
                    yield tail, fresh
                self.finish_reason = "stop" if self.stops.stopped else event.reason
                return
            if event.logprob is not None:
                fresh.append(event.logprob)
                self.entries.append(event.logprob)
            text = self.stops.feed(event.text)
            if self.stops.stopped:
                self.generation.cancel.set()  # no need to decode past a stop string
            if text:
                yield text, fresh
                fresh = []

    def cancel(self) -> None:
        self.generation.cancel.set()


class Reply:
    """Turns the choices' events into an OpenAI response, whole or as server-sent events."""

    def __init__(
        self,
        model: str,
        chat: bool,
        prompt_tokens: int,
        choices: list[Choice],
        scope: MutableMapping,
        logprobs: bool = False,
    ):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.choices, self.with_logprobs = choices, logprobs
        self.scope = scope  # where a stream that fails after its headers reports it (serve.app counts it)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def cancel(self) -> None:
        for choice in self.choices:
            choice.cancel()

    async def whole(self, timeout_s: float) -> JSONResponse:
        async def collect(choice: Choice) -> str:
            return "".join([text async for text, _ in choice.pieces()])

        try:
            texts = await asyncio.wait_for(asyncio.gather(*(collect(c) for c in self.choices)), timeout_s)
        except asyncio.TimeoutError:
            raise timed_out(timeout_s) from None
        finally:
            self.cancel()
        return JSONResponse(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [self.whole_choice(c, text) for c, text in zip(self.choices, texts)],
                "usage": self.usage(),
            }
        )

    def whole_choice(self, choice: Choice, text: str) -> dict:
        # The message first: the tool calls it finds set the choice's finish_reason.
        body = {"message": self.message(choice, text)} if self.chat else {"text": text}
        return {
            "index": choice.index,
            "finish_reason": choice.finish_reason,
            "logprobs": self.logprobs(choice.entries, 0) if self.with_logprobs else None,
            **body,
        }

    @staticmethod
    def message(choice: Choice, text: str) -> dict:
        """The assistant message of a choice: its text, or the tool calls it wrote."""
        if choice.calls is None:
            return {"role": "assistant", "content": text}
        choice.calls.feed(text)
        content, calls = choice.calls.finish()
        if not calls:
            return {"role": "assistant", "content": text}
        choice.finish_reason = "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def logprobs(self, entries: list[dict], offset: int) -> dict:
        from serve.llm.logprobs import chat_logprobs, completion_logprobs

        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)

    def usage(self) -> dict:
        done = sum(c.generation.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    async def merged(self):
        """(choice, (text, entries)) from every choice as they come, then (choice, None) at its end."""
        if len(self.choices) == 1:  # the common case, without a task and a queue per token
            choice = self.choices[0]
            async for piece in choice.pieces():
                yield choice, piece
            yield choice, None
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for piece in choice.pieces():
                    await queue.put((choice, piece))
                await queue.put((choice, None))
            except Exception as exc:
                await queue.put((choice, exc))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            for _ in self.choices:
                while True:
                    choice, item = await queue.get()
                    if isinstance(item, Exception):
                        raise item
                    yield choice, item
                    if item is None:
                        break
        finally:
            for task in tasks:
                task.cancel()

    async def stream(self, timeout_s: float, include_usage: bool) -> StreamingResponse:
        """Wait for the first piece within the timeout (so a 504 is still possible), then stream."""
        items = self.merged()
        try:
            first = await asyncio.wait_for(anext(items), timeout_s)
        except asyncio.TimeoutError:
            self.cancel()
            raise timed_out(timeout_s) from None
        return StreamingResponse(
            self.events(first, items, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def events(self, first, items, include_usage: bool):
        try:
            if self.chat:
                for choice in self.choices:
                    yield self.sse(self.chunk(choice, {"role": "assistant", "content": ""}))
            for event in self.item_events(*first):
                yield event
            async for choice, item in items:
                for event in self.item_events(choice, item):
                    yield event
            if include_usage:
                yield self.sse({**self.envelope(), "choices": [], "usage": self.usage()})
        except Exception as exc:  # headers are sent: the error can only travel in the stream
            self.scope[STREAM_FAILED] = True
            yield self.sse({"error": {"message": f"generation failed: {exc}", "type": "server_error"}})
        finally:
            self.cancel()  # also when the client disconnects mid-stream
        yield "data: [DONE]\n\n"

    def item_events(self, choice: Choice, item):
        """The chunks of one item of a choice: a piece of text (none while a tool call may be being
        written), or at its end what tools held back and the finish."""
        if item is None:
            yield from self.held_back(choice)
            yield self.sse(self.chunk(choice, None, choice.finish_reason))
            return
        text, entries = item
        if choice.calls is not None:
            text = choice.calls.feed(text)
        logprobs = self.logprobs(entries, choice.text_length) if entries else None
        choice.text_length += len(text)
        if text or logprobs is not None:
            yield self.sse(self.chunk(choice, text, logprobs=logprobs))

    def held_back(self, choice: Choice):
        """At the end of a choice with tools: the tool calls it wrote, or the text held back."""
        if choice.calls is None:
            return
        from serve.llm.tools import call_deltas

        content, calls = choice.calls.finish()
        if content:
            yield self.sse(self.chunk(choice, content))
        for delta in call_deltas(calls):
            yield self.sse(self.chunk(choice, delta))
        if calls:
            choice.finish_reason = "tool_calls"

    def envelope(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, choice: Choice, content, finish_reason=None, logprobs=None) -> dict:
        out: dict[str, Any] = {"index": choice.index}
        if self.chat:
            out["delta"] = content if isinstance(content, dict) else ({} if content is None else {"content": content})
        else:
            out["text"] = content or ""
        out.update(finish_reason=finish_reason, logprobs=logprobs)
        return {**self.envelope(), "choices": [out]}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


# --- the protocol: routes, OpenAPI paths, error body ----------------------------------------------


def openai_paths(state) -> dict:
    def post(summary, schema, ok):
        return {
            "post": {
                "tags": ["openai"],
                "summary": summary,
                "requestBody": {"required": True, **json_body(schema)},
                "responses": {"200": ok, **errors("OpenAIError", *OPENAI_ERRORS)},
            }
        }

    def streamable(schema):
        return {
            "description": "the completion, or server-sent events with stream: true",
            "content": {
                "application/json": {"schema": ref(schema)},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        }

    def with_model(schema):
        return {
            **SCHEMAS[schema],
            "properties": {
                **SCHEMAS[schema]["properties"],
                "model": {"type": "string", "example": state.name},
            },
        }

    return {
        "/v1/models": {
            "get": {
                "tags": ["openai"],
                "summary": "the served model",
                "responses": {"200": {"description": "models", **json_body(ref("ModelList"))}},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "tags": ["openai"],
                "summary": "one model",
                "parameters": [path_param("model", state.name)],
                "responses": {
                    "200": {"description": "model", **json_body(ref("Model"))},
                    **errors("OpenAIError", 404, 405),
                },
            }
        },
        "/v1/embeddings": post(
            "embeddings (encoders)",
            with_model("EmbeddingsRequest"),
            {"description": "embeddings", **json_body(ref("EmbeddingsResponse"))},
        ),
        "/v1/completions": post(
            "text completion (causal LMs)", with_model("CompletionRequest"), streamable("CompletionResponse")
        ),
        "/v1/chat/completions": post(
            "chat completion (causal LMs)", with_model("ChatRequest"), streamable("ChatResponse")
        ),
    }


SPEC = ProtocolSpec("openai", routes, openai_paths, openai_error_body, prefixes=("/v1",))
