"""A text classifier (sequence or token classification) behind the batcher: the encoder's
tokenizing, checks and batching (serve/encoder/model.py), logits out, and the artifact's labels.json
(written by the pipeline from the model's id2label) to name them.

KServe v2 serves the logits as tensors ([rows, labels], or [rows, sequence, labels] for a token
classifier); for a sequence classifier (TextClassifierModel) /predict (serve/protocols/predict.py) also
answers as Text Embeddings Inference's classification route does: every label with its softmax
score, highest first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np

from serve.encoder.model import EncoderBatchItem, EncoderModel
from serve.errors import unprocessable

LABELS_FILE = "labels.json"


def read_labels(root: Path) -> list[str]:
    """Label names by id from labels.json; LABEL_i where the file leaves an id out."""
    path = root / LABELS_FILE
    if not path.is_file():
        raise ValueError(f"{root} has no {LABELS_FILE}: the artifact does not say what its classes are")
    id2label = {int(k): str(v) for k, v in json.loads(path.read_text())["id2label"].items()}
    return [id2label.get(i, f"LABEL_{i}") for i in range(max(id2label) + 1)]


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


class ClassifierModel(EncoderModel):
    """Any classifier's logits as tensors (a token classifier's are per token: no /predict rows)."""

    ANSWERS: ClassVar[frozenset[str]] = frozenset({"tensors"})
    USE: ClassVar[str] = "a {task} model: use /v2/models/{name}/infer for its logits"

    def __init__(self, root: Path, engine: dict, threads: int = 0, spinning: bool = False):
        super().__init__(root, engine, threads, spinning)
        self.task = engine["task"]
        self.labels = read_labels(root)


class TextClassifierModel(ClassifierModel):
    """One row of logits per text: /predict names them, every label with its score."""

    ANSWERS: ClassVar[frozenset[str]] = frozenset({"tensors", "predict"})
    USE: ClassVar[str] = "a text classifier: use /predict, or /v2/models/{name}/infer for its logits"

    def from_texts_checked(self, texts: list[str], truncate: bool) -> EncoderBatchItem:
        """Texts tokenized; one past max_length tokens is refused unless the client asks to truncate
        (as Text Embeddings Inference does: a cut text is classified on part of what was sent)."""
        kept = self.cut(texts)
        encodings = self.text.tokenizer.encode_batch(kept)
        cut = [i for i, (e, k, t) in enumerate(zip(encodings, kept, texts)) if e.overflowing or len(k) < len(t)]
        if cut and not truncate:
            raise unprocessable(
                f"inputs[{cut[0]}] is longer than the {self.max_length} tokens this model takes; "
                "send truncate: true to cut it"
            )
        return EncoderBatchItem(
            {
                "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
            }
        )

    def predictions(self, logits: np.ndarray, raw_scores: bool = False) -> list[list[dict]]:
        """Per text: every label with its score (softmax, or the raw logit), highest first."""
        scores = logits if raw_scores else softmax(logits.astype(np.float64))
        rows = []
        for row in scores:
            order = np.argsort(-row, kind="stable")
            rows.append([{"label": self.labels[i], "score": float(row[i])} for i in order])
        return rows
