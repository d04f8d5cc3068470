"""Text to model inputs with the `tokenizers` library: the same code in the pipeline and in serve/."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# A token of these tokenizers covers at most this many characters of text (WordPiece reads words of up
# to 100 characters; a longer one is a single [UNK]), so the first max_length tokens of a text lie in
# its first max_length * CHARS_PER_TOKEN characters: a text is cut there before it is tokenized, and a
# 30 MB one costs what a short one does. (Only a run of thousands of spaces between tokens could push
# a token past the cut, which then shortens that text's encoding; nothing unbounded is tokenized.)
CHARS_PER_TOKEN = 128


class TextEncoder:
    """Tokenizes a batch of texts into input_ids / attention_mask / token_type_ids (int64)."""

    def __init__(self, tokenizer_dir: str | Path, max_length: int = 128):
        from tokenizers import Tokenizer

        self.folder = Path(tokenizer_dir)  # with the tokenizer's config and chat template
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.max_length = max_length
        self.tokenizer.enable_truncation(max_length)
        pad_id = self.tokenizer.token_to_id("[PAD]")
        self.tokenizer.enable_padding(pad_id=pad_id if pad_id is not None else 0)

    def __call__(self, texts: list[str]) -> dict[str, np.ndarray]:
        encodings = self.tokenizer.encode_batch(self.bounded(texts))
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }

    def bounded(self, texts) -> list[str]:
        """Each text cut to the characters its first max_length tokens can come from."""
        limit = self.max_length * CHARS_PER_TOKEN
        return [text[:limit] for text in texts]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)
