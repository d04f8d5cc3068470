"""Every field of the OpenAI /v1/completions and /v1/chat/completions request bodies, and what this
server does with it: one table (FIELDS), read by the parser to refuse (serve/protocols/openai.py), by
the model wrapper to refuse what its engine cannot do (serve/llm/model.py), and rendered into serve/README.md
(`python -m optimize.docs.tables`).

A field is honoured, honoured where the engine declares it (its `honours`, engines/generation.py),
accepted without effect (an identifier or a hint that changes no output), or refused with a 400 that
names it in `param`. Fields the table does not know are refused too: OpenAI's own server rejects them,
and a client that sends a field expects it to do something (vLLM ignores unknown fields; a client
whose option silently does nothing gets data that looks right and is not). The field list is the
official `openai` client's (`openai.types.chat.completion_create_params`,
`openai.types.completion_create_params`), plus vLLM's sampling extensions this server honours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from serve.errors import bad_request

CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
Handling = Literal["honoured", "per engine", "no effect", "refused"]


@dataclass(frozen=True)
class Field:
    name: str
    routes: tuple[str, ...]
    handling: Handling
    note: str
    # "per engine": the engines.generation.Sampling field each engine declares it honours or not.
    sampling: str | None = None
    # "refused": the values that ask for nothing and are accepted (null always is).
    harmless: Callable[[Any], bool] | None = None


def equals(*values) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


FIELDS: tuple[Field, ...] = (
    Field("model", BOTH, "honoured", "the served model's name (`GET /v1/models`); another name is a 404"),
    Field("messages", (CHAT,), "honoured", "text (a string or text parts), through the model's chat template"),
    Field("prompt", (COMPLETIONS,), "honoured", "a string or a list of token ids; one prompt per request"),
    Field("max_tokens", BOTH, "honoured", "within `--max-tokens`, the context and the KV cache"),
    Field("max_completion_tokens", (CHAT,), "honoured", "as `max_tokens` (it wins where both are given)"),
    Field("temperature", BOTH, "honoured", "0 to 2; below 1e-5 (0 included): greedy"),
    Field("top_p", BOTH, "honoured", "0 to 1, with temperature > 0; below 1e-5 (0 included): greedy"),
    Field("stop", BOTH, "honoured", "up to 4 strings, cut from the text by the server"),
    Field("stream", BOTH, "honoured", "server-sent events"),
    Field("stream_options", BOTH, "honoured", "`include_usage` only (another key is a 400)"),
    Field("seed", BOTH, "honoured", "within the engine's seed range; with `n` > 1, choice i takes seed + i"),
    Field(
        "n",
        BOTH,
        "honoured",
        "1 to 16: that many independent generations of the prompt, scheduled by the engine "
        "(batched together where it batches)",
    ),
    Field(
        "logprobs",
        BOTH,
        "per engine",
        "chat: `true`; completions: the number of alternatives (0 to 20). One entry per generated token",
        sampling="logprobs",
    ),
    Field(
        "top_logprobs",
        (CHAT,),
        "per engine",
        "alternatives per token (0 to 20, needs `logprobs: true`), at most the engine's limit",
        sampling="top_logprobs",
    ),
    Field("top_k", BOTH, "per engine", "vLLM's extension: sample among the k most likely; 0 or -1: no cut", "top_k"),
    Field("min_p", BOTH, "per engine", "vLLM's extension, 0 to 1 (1: greedy)", sampling="min_p"),
    Field(
        "repetition_penalty",
        BOTH,
        "per engine",
        "vLLM's extension, 0.01 to 10 (1: none); applies to greedy decoding too",
        sampling="repetition_penalty",
    ),
    Field("presence_penalty", BOTH, "per engine", "-2 to 2", sampling="presence_penalty"),
    Field("frequency_penalty", BOTH, "per engine", "-2 to 2", sampling="frequency_penalty"),
    Field("user", BOTH, "no effect", "an end-user identifier: accepted, changes nothing"),
    Field("safety_identifier", (CHAT,), "no effect", "an end-user identifier: accepted, changes nothing"),
    Field("prompt_cache_key", (CHAT,), "no effect", "a hint: prefix caching is automatic where the engine has it"),
    Field("metadata", (CHAT,), "no effect", "tags for stored completions; nothing is stored"),
    Field("store", (CHAT,), "refused", "nothing is stored: `false` only", harmless=equals(False)),
    Field("service_tier", (CHAT,), "refused", "one tier: `auto` or `default` only", harmless=equals("auto", "default")),
    Field("modalities", (CHAT,), "refused", 'text only: `["text"]`', harmless=equals(["text"])),
    Field(
        "response_format",
        BOTH,
        "per engine",
        "`text`, `json_object`, `json_schema` (with `strict`) through the engine's constrained decoding "
        "(ONNX Runtime GenAI: llguidance; OpenVINO GenAI: xgrammar, on a checked subset of JSON Schema); "
        "another type, or a schema the engine cannot take, is a 400 with the reason",
        sampling="constraint",
    ),
    Field(
        "structured_outputs",
        BOTH,
        "per engine",
        "vLLM's extension: `regex`, `choice`, `json` (a schema) or `grammar` (Lark, ONNX Runtime GenAI only; "
        "a 400 on OpenVINO GenAI); one of them, not with `response_format`",
        sampling="constraint",
    ),
    Field(
        "tools",
        (CHAT,),
        "honoured",
        "up to 128 functions named `[a-zA-Z0-9_-]{1,64}`, rendered by the model's chat template (the "
        "server's fallback where the template takes no tools; the startup line says which)",
    ),
    Field(
        "tool_choice",
        (CHAT,),
        "per engine",
        "`none`, `auto` (the output is parsed for calls), `required` or a named function (the output is "
        "constrained to a call whose arguments match the tool's schema); `finish_reason` `tool_calls`",
        sampling="constraint",
    ),
    Field("parallel_tool_calls", (CHAT,), "honoured", "`true` or `false`: a forced call is one call"),
    Field("functions", (CHAT,), "refused", "the deprecated form of `tools`", harmless=equals([])),
    Field("function_call", (CHAT,), "refused", "the deprecated form of `tool_choice`", harmless=equals("none")),
    Field("logit_bias", BOTH, "refused", "neither engine takes a bias per token", harmless=equals({})),
    Field("audio", (CHAT,), "refused", "text only"),
    Field("prediction", (CHAT,), "refused", "no predicted-output decoding"),
    Field("reasoning_effort", (CHAT,), "refused", "not a reasoning model's server"),
    Field("verbosity", (CHAT,), "refused", "no verbosity control"),
    Field("web_search_options", (CHAT,), "refused", "no web search"),
    Field("moderation", (CHAT,), "refused", "no moderation"),
    Field("prompt_cache_retention", (CHAT,), "refused", "the prefix cache keeps what fits, for no set time"),
    Field("prompt_cache_options", (CHAT,), "refused", "the prefix cache takes no options per request"),
    Field("best_of", (COMPLETIONS,), "refused", "1 only (use `n`)", harmless=equals(1)),
    Field("echo", (COMPLETIONS,), "refused", "`false` only", harmless=equals(False)),
    Field("suffix", (COMPLETIONS,), "refused", "no fill-in-the-middle", harmless=equals("")),
)

BY_ROUTE: dict[str, dict[str, Field]] = {route: {f.name: f for f in FIELDS if route in f.routes} for route in BOTH}
# The request field that asks for each engine-dependent Sampling field, as a refusal names it.
PARAM_OF_SAMPLING = {f.sampling: f.name for f in FIELDS if f.sampling}


def refuse_unserved_fields(data: dict, route: str) -> None:
    """400 naming the first field of a request body this server does not honour: unknown, or refused
    with a value that asks for something (engine-dependent fields are checked by serve/llm/model.py)."""
    known = BY_ROUTE[route]
    for name, value in data.items():
        row = known.get(name)
        if row is None:
            raise bad_request(f"unknown field {name!r}: this server does not take it", param=name)
        if row.handling == "refused" and value is not None and not (row.harmless and row.harmless(value)):
            raise bad_request(f"{name!r} is not supported: {row.note}", param=name)


# --- the table in serve/README.md -----------------------------------------------------------------


def engine_modes() -> list[tuple[str, type]]:
    """(column title, engine class) for each generating format, batched and one at a time, read from
    the loaders' return types in engines/formats.py (the classes declare what they honour)."""
    from engines import formats

    modes = []
    for row in formats.FORMATS.values():
        if row.serves != "causal_lm":
            continue
        batched = row.batch_class()
        if batched is not None:
            modes.append((f"{row.name} ({row.batching} batching)", batched))
        modes.append((f"{row.name} (--max-num-seqs 1)", row.loaded_class()))
    return modes


def engine_cell(row: Field, engine: type) -> str:
    if row.sampling is None:
        return {"honoured": "yes", "no effect": "no effect", "refused": "400"}[row.handling]
    if row.sampling not in getattr(engine, "honours", ()):
        return "400"
    if row.sampling == "top_logprobs" or (row.sampling == "logprobs" and COMPLETIONS in row.routes):
        return f"yes (at most {getattr(engine, 'max_top_logprobs', 0)} alternatives)"
    return "yes"


def fields_table() -> str:
    """The markdown table of FIELDS, one column per engine mode."""
    modes = engine_modes()
    header = ["Field", "Routes", *[title for title, _ in modes], "Note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in FIELDS:
        cells = [f"`{row.name}`", ", ".join(row.routes), *[engine_cell(row, cls) for _, cls in modes], row.note]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
