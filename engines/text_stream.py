"""Streaming detokenization in the Hugging Face `tokenizers` library, for engines whose own decode is
costly per call.

A server that streams text decodes each sequence's new token after every step. OpenVINO GenAI's
Tokenizer.decode runs the detokenizer IR, an inference of its own: measured beside a running
continuous-batching pipeline on a 2-core Zen 4, 0.3 ms a call at one client (3% of its decode step)
and 0.08 ms at 16, once for each of a step's 16 sequences. It also decodes the whole text so far, so a stream
costs O(n^2) in its length. `tokenizers.decoders.DecodeStream` keeps the few ids that are not yet
text and answers a token in about a microsecond.

Where the artifact holds the model's tokenizer.json, HFStreams uses it, but only after checking, once,
that it writes the same text as the engine's own decode on sample texts (ASCII, code, multi-byte
UTF-8, the special tokens the engine skips, and every added token the file lists), streamed and
decoded whole, and each of their tokens alone (the text of one token, which logprobs give). Where it
does not, the engine keeps its own decode:
the two tokenizers came from the same files, and a difference between them is a difference in what
clients read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("engines")

# Texts whose tokens, decoded one at a time, must give what the engine's decode gives for all of them.
CHECK_TEXTS = (
    "The quick brown fox jumps over the lazy dog.  Two spaces, a tab\there, and a newline\n",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # {'key': [1, 2]}\n",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 😀🚀 and ½ → ∞",
    "   leading spaces, trailing spaces   ",
)
# Added tokens (special or not) the check places among the sample texts, at most, and per sequence.
MAX_ADDED_CHECKED = 512
ADDED_PER_SEQUENCE = 64


class HFTextStream:
    """One sequence's streaming decoder: decode(token) is the text that token completes ("" while the
    token ends inside a multi-byte character)."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def decode(self, token: int) -> str:
        return self.stream.step(self.tokenizer, int(token)) or ""


class HFStreams:
    """Makes an HFTextStream per sequence from one loaded tokenizer."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def __call__(self) -> HFTextStream:
        return HFTextStream(self.tokenizer, self.skip_special_tokens)

    def streamed(self, ids: list[int]) -> str:
        stream = self()
        return "".join(stream.decode(token) for token in ids)

    def decode(self, ids: list[int]) -> str:
        """The whole text of ids at once (a token's text for logprobs, say)."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=self.skip_special_tokens)


def check_sequences(tokenizer, special_ids: list[int]) -> list[list[int]]:
    """The id sequences the check decodes: each sample text, alone and with the special tokens placed
    at its start, in its middle and at its end, and the sample texts around every added token the
    tokenizer file lists (up to MAX_ADDED_CHECKED of them), special or not: whether such a token is
    skipped or written is where two conversions of one tokenizer can differ."""
    sequences = []
    samples = [tokenizer.encode(text, add_special_tokens=False).ids for text in CHECK_TEXTS]
    for ids in samples:
        middle = len(ids) // 2
        sequences.append(ids)
        sequences.append(special_ids + ids[:middle] + special_ids + ids[middle:] + special_ids)
    added = sorted(tokenizer.get_added_tokens_decoder())[:MAX_ADDED_CHECKED]
    for start in range(0, len(added), ADDED_PER_SEQUENCE):
        around = samples[(start // ADDED_PER_SEQUENCE) % len(samples)]
        sequences.append(around[:8] + added[start : start + ADDED_PER_SEQUENCE] + around[8:])
    return sequences


def hf_streams(
    tokenizer_json: Optional[Path], engine_decode: Callable[[list[int]], str], special_ids: list[int]
) -> Optional[HFStreams]:
    """HFStreams over tokenizer_json when it streams exactly what engine_decode decodes (special
    tokens skipped, as the engines decode for clients); None where the file is missing, does not load
    or writes other text (the reason logged)."""
    if tokenizer_json is None or not tokenizer_json.is_file():
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 (tokenizers 0.21 and later)

        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # an unreadable file only costs the fast path
        log.info("streaming detokenizer: %s does not load (%s); the engine decodes", tokenizer_json, exc)
        return None
    streams = HFStreams(tokenizer)
    sequences = check_sequences(tokenizer, special_ids)
    # decode() also answers single tokens (a token's text for logprobs), a byte of a character among
    # them, which both write as U+FFFD; a stream holds such a byte back, so singles check decode() only.
    samples = sequences[: 2 * len(CHECK_TEXTS) : 2]
    singles = [[token] for token in dict.fromkeys(t for ids in samples for t in ids)]
    checks = [(ids, streams.streamed) for ids in sequences] + [(ids, streams.decode) for ids in sequences + singles]
    for ids, write in checks:
        expected, got = engine_decode(ids), write(ids)
        if got != expected:
            log.warning(
                "streaming detokenizer: %s writes %r where the engine writes %r; the engine decodes",
                tokenizer_json,
                got[:80],
                expected[:80],
            )
            return None
    return streams
