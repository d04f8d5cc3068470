"""OpenAI-compatible endpoints: /v1/models, /v1/embeddings, /v1/completions, /v1/chat/completions.

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
from typing import Any, MutableMapping

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from serve.body import arriving, read_body
from serve.errors import HTTPError, bad_request, openai_error_body, timed_out
from serve.jsonbody import FastJSONResponse, array
from serve.openapi import OPENAI_ERRORS, SCHEMAS, errors, json_body, path_param, ref
from serve.protocol import json_object, parse_chat_request, parse_completion_request, parse_embeddings_request
from serve.spec import ProtocolSpec
from serve.state import STREAM_FAILED, state_of


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


# --- embeddings ----------------------------------------------------------------------------------


async def embeddings(request: Request) -> FastJSONResponse:
    from serve.kserve_routes import run_encoder

    state = state_of(request)
    with arriving(state.batcher):
        parsed = parse_embeddings_request(await read_json(request, state), state.config.max_inputs)
        check_model(state, parsed.model, "embeddings")
        state.require_ready()
        model = state.model
        if parsed.dimensions is not None and parsed.dimensions != model.embedding_dim:
            raise bad_request(
                f"this model's embeddings have {model.embedding_dim} dimensions; 'dimensions' cannot change that",
                param="dimensions",
            )
        item = model.from_texts(parsed.texts) if parsed.texts is not None else model.from_token_ids(parsed.token_ids)
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
    from serve.stops import StopMatcher

    state = state_of(request)
    parsed = parse(await read_json(request, state))
    check_model(state, parsed.model, "completions")
    state.require_ready()
    model = state.model
    prompt_ids, sampling = model.prepare(parsed)
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    generation = state.generator.submit(prompt_ids, sampling)
    reply = Reply(state.name, chat, len(prompt_ids), generation, StopMatcher(parsed.stop), request.scope)
    if parsed.tools is not None and parsed.tools.active:
        from serve.tools import ToolCallStream

        reply.calls = ToolCallStream(parsed.tools)
    if parsed.stream:
        return await reply.stream(state.config.timeout_s, parsed.include_usage)
    return await reply.whole(state.config.timeout_s)


class Reply:
    """Turns one generation's events into an OpenAI response, whole or as server-sent events."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, generation, stops, scope: MutableMapping):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.generation, self.stops = generation, stops
        self.scope = scope  # where a stream that fails after its headers reports it (serve.app counts it)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.finish_reason: str | None = None
        self.calls: Any = None  # serve.tools.ToolCallStream of a request whose tools are active

    async def pieces(self):
        """Text pieces with stop strings applied; sets finish_reason at the end."""
        while True:
            kind, value = await self.generation.events.get()
            if kind == "error":
                raise value
            if kind == "end":
                tail = self.stops.flush()
                if tail:
                    yield tail
                self.finish_reason = "stop" if self.stops.stopped else value
                return
            text = self.stops.feed(value)
            if self.stops.stopped:
                self.generation.cancel.set()  # no need to decode past a stop string
            if text:
                yield text

    async def whole(self, timeout_s: float) -> JSONResponse:
        async def collect():
            return "".join([piece async for piece in self.pieces()])

        try:
            text = await asyncio.wait_for(collect(), timeout_s)
        except asyncio.TimeoutError:
            raise timed_out(timeout_s) from None
        finally:
            self.generation.cancel.set()
        body: dict[str, Any] = {"message": self.message(text)} if self.chat else {"text": text}
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None, **body}
        return JSONResponse(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage(),
            }
        )

    def message(self, text: str) -> dict:
        if self.calls is None:
            return {"role": "assistant", "content": text}
        self.calls.feed(text)
        content, calls = self.calls.finish()
        if not calls:
            return {"role": "assistant", "content": text}
        self.finish_reason = "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def usage(self) -> dict:
        done = self.generation.tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    async def stream(self, timeout_s: float, include_usage: bool) -> StreamingResponse:
        """Wait for the first piece within the timeout (so a 504 is still possible), then stream."""
        pieces = self.pieces()
        try:
            first = await asyncio.wait_for(anext(pieces, None), timeout_s)
        except asyncio.TimeoutError:
            self.generation.cancel.set()
            raise timed_out(timeout_s) from None
        return StreamingResponse(
            self.events(first, pieces, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def events(self, first, pieces, include_usage: bool):
        try:
            if self.chat:
                yield self.sse(self.chunk({"role": "assistant", "content": ""}))
            if first is not None:
                for text in self.content(first):
                    yield text
                async for piece in pieces:
                    for text in self.content(piece):
                        yield text
            for text in self.held_back():
                yield text
            yield self.sse(self.chunk(None, self.finish_reason))
            if include_usage:
                yield self.sse({**self.chunk(None), "choices": [], "usage": self.usage()})
        except Exception as exc:  # headers are sent: the error can only travel in the stream
            self.scope[STREAM_FAILED] = True
            yield self.sse({"error": {"message": f"generation failed: {exc}", "type": "server_error"}})
        finally:
            self.generation.cancel.set()  # also when the client disconnects mid-stream
        yield "data: [DONE]\n\n"

    def content(self, piece: str):
        """The chunk of a piece (none while a tool call may be being written)."""
        if self.calls is not None:
            piece = self.calls.feed(piece)
        if piece:
            yield self.sse(self.chunk(piece))

    def held_back(self):
        """At the end of a stream with tools: the tool calls written, or the text held back."""
        if self.calls is None:
            return
        from serve.tools import call_deltas

        content, calls = self.calls.finish()
        if content:
            yield self.sse(self.chunk(content))
        for delta in call_deltas(calls):
            yield self.sse(self.chunk(delta))
        if calls:
            self.finish_reason = "tool_calls"

    def chunk(self, content, finish_reason=None) -> dict:
        if self.chat:
            delta = content if isinstance(content, dict) else ({} if content is None else {"content": content})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": content or "", "finish_reason": finish_reason, "logprobs": None}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

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
