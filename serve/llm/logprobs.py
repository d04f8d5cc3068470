"""Log-probabilities in OpenAI's two shapes: an engine's TokenLogprob (engines/generation.py) becomes
one entry with the token's text (decoded in the thread that runs the engine, the only one that uses
its tokenizer), and a choice's entries become chat's `logprobs.content` or the completions API's
legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

A token's `bytes` are the UTF-8 of its decoded text: a token that holds part of a character decodes
to U+FFFD, whose bytes are given, not the token's raw bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.generation import TextModel, TokenLogprob


def token_entry(text_model: TextModel, scored: TokenLogprob) -> dict:
    """Chat's entry for one token: token, logprob, bytes, top_logprobs (each token, logprob, bytes)."""

    def one(token: int, logprob: float) -> dict:
        text = text_model.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**one(scored.token, scored.logprob), "top_logprobs": [one(t, lp) for t, lp in scored.top]}


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The legacy shape; `offset` is where the first token's text starts in the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
