"""`POST /tokenize` and `POST /detokenize` for causal LMs, in llama.cpp server's shape, with vLLM's
and OpenVINO Model Server's field names accepted too: text in, the token ids a completion prompt of
that text becomes (what `max_tokens` and the context length count); token ids in, their text.

    {"content": "Hello"}  ->  {"tokens": [...], "count": N, "max_model_len": CONTEXT}
    {"tokens": [...]}     ->  {"content": "Hello", "prompt": "Hello"}

The text goes in `content` (llama.cpp), `prompt` (vLLM) or `text` (OVMS); `messages` tokenizes a
conversation as /v1/chat/completions renders it. `model` is optional and, when given, must name the
served model.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve.errors import bad_request, openai_error_body
from serve.llm.model import GenerativeModel
from serve.protocols.openai import check_model, parse_message, read_json
from serve.protocols.openapi import OPENAI_ERRORS, errors, json_body
from serve.protocols.parsing import is_int
from serve.protocols.spec import ProtocolSpec
from serve.state import state_of

TEXT_KEYS = ("content", "prompt", "text")


def routes() -> list[Route]:
    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]


async def text_model(request: Request):
    """The request's JSON body and the served causal LM's runner (its tokenizer)."""
    state = state_of(request)
    data = await read_json(request, state)
    if data.get("model") is not None:
        check_model(state, str(data["model"]))
    state.require_answers("completions")
    return data, state.ready_model(GenerativeModel)


async def tokenize(request: Request) -> JSONResponse:
    import asyncio

    data, model = await text_model(request)
    # A key given as null counts as given (and is refused as not a string): the document types them.
    given = [key for key in (*TEXT_KEYS, "messages") if key in data]
    if len(given) != 1:
        raise bad_request(f"give the text in one of {', '.join(TEXT_KEYS)} (or 'messages')", param="content")
    key = given[0]
    if key == "messages":
        raw = data["messages"]
        if not isinstance(raw, list) or not raw:
            raise bad_request("'messages' must be a non-empty list", param="messages")
        messages = [parse_message(m, i) for i, m in enumerate(raw)]
        check_length(sum(len(m["content"]) for m in messages), model.context_length, key)
        text: str | list[dict] = messages
    elif isinstance(data[key], str):
        text = data[key]
        check_length(len(text), model.context_length, key)
    else:
        raise bad_request(f"'{key}' must be a string", param=key)
    # Rendering and tokenizing in the model's tokenizing thread, off the event loop (serve/llm/model.py).
    tokens = await asyncio.get_running_loop().run_in_executor(model.tokenizing, tokens_of, model, text)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": model.context_length})


def check_length(characters: int, context_length: int, key: str) -> None:
    """400 for a text longer in characters than the context can hold, before it is tokenized."""
    from serve.body import MAX_CHARS_PER_TOKEN

    limit = context_length * MAX_CHARS_PER_TOKEN
    if characters > limit:
        raise bad_request(
            f"'{key}' has {characters} characters, more than the context of {context_length} tokens can hold: "
            f"at most {limit} are tokenized",
            param=key,
        )


def tokens_of(model, text: str | list[dict]) -> list[int]:
    """The token ids of a text, or of a conversation as the model's chat template renders it."""
    from serve.llm.model import refused_by_template

    if isinstance(text, list):
        text = refused_by_template(model.runner.chat_prompt, text)
    return model.runner.encode(text)


async def detokenize(request: Request) -> JSONResponse:
    data, model = await text_model(request)
    tokens = data.get("tokens")
    vocab = model.runner.vocab_size
    if not isinstance(tokens, list) or not all(is_int(t) and t >= 0 and (not vocab or t < vocab) for t in tokens):
        bound = f"[0, {vocab})" if vocab else "non-negative"
        raise bad_request(f"'tokens' must be a list of token ids in {bound}", param="tokens")
    text = model.runner.decode(tokens) if tokens else ""
    return JSONResponse({"content": text, "prompt": text})


def tokenize_paths(state) -> dict:
    def post(summary: str, request: dict, response: dict) -> dict:
        return {
            "post": {
                "tags": ["tokenize"],
                "summary": summary,
                "requestBody": {"required": True, **json_body(request)},
                "responses": {
                    "200": {"description": summary, **json_body(response)},
                    **errors("OpenAIError", *OPENAI_ERRORS),
                },
            }
        }

    text = {"type": "string", "example": "Hello"}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    return {
        "/tokenize": post(
            "text to token ids (causal LMs)",
            {
                "type": "object",
                "properties": {
                    **{key: text for key in TEXT_KEYS},
                    "messages": {"type": "array", "items": {"type": "object"}},
                    "model": {"type": "string", "example": state.name},
                },
            },
            {
                "type": "object",
                "required": ["tokens"],
                "properties": {"tokens": ids, "count": {"type": "integer"}, "max_model_len": {"type": "integer"}},
            },
        ),
        "/detokenize": post(
            "token ids to text (causal LMs)",
            {
                "type": "object",
                "required": ["tokens"],
                "properties": {"tokens": ids, "model": {"type": "string", "example": state.name}},
            },
            {"type": "object", "required": ["content"], "properties": {"content": text, "prompt": text}},
        ),
    }


SPEC = ProtocolSpec("tokenize", routes, tokenize_paths, openai_error_body)
