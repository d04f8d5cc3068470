"""Token classification (NER): a Hugging Face AutoModelForTokenClassification judged on labeled
words, gated on the entity-level F1 drop (seqeval's definition) and word accuracy drop in points.

    model: {source: DIR_OR_HUB_ID, task: token_classification}
    evaluate:
      data: {source: labeled, path: ner_saved_dataset/, field: tokens, label_field: ner_tags, dataset_split: test}
    gate: {max_f1_drop: 1.0, min_prediction_agreement: 0.99}

Examples are lists of words with one tag per word (names from the model's id2label, or ids; a
`datasets` ClassLabel column is read back as names). Words are tokenized as pre-split words; a
word's prediction is its first sub-token's, as the Hugging Face NER examples label them. Words
past model.max_length are predicted "O" on both sides (the report counts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from optimize.errors import RecipeError
from optimize.tasks import register_task
from optimize.tasks.labeled_text import LabeledTextTask, id2label_of, label_ids, require_classes

if TYPE_CHECKING:
    from optimize.context import Context


class WordEncoder:
    """The artifact's tokenizer on word lists (pre-split, is_pretokenized) or on plain text (calibration)."""

    def __init__(self, text_encoder):
        self.text = text_encoder

    def __call__(self, items: list) -> dict[str, np.ndarray]:
        if not items or isinstance(items[0], str):
            return self.text(items)
        encodings = self.text.tokenizer.encode_batch([list(words) for words in items], is_pretokenized=True)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }

    def word_ids(self, items: list) -> list[list[int | None]]:
        return [e.word_ids for e in self.text.tokenizer.encode_batch([list(w) for w in items], is_pretokenized=True)]

    def count_tokens(self, text: str) -> int:
        return self.text.count_tokens(text)


def word_predictions(
    logits: np.ndarray, word_ids: list[list[int | None]], words: list[int], fill: int
) -> list[list[int]]:
    """Each word's predicted id: the argmax at its first sub-token; `fill` for words cut by truncation."""
    predicted = logits.argmax(-1)
    rows = []
    for row, (ids, count) in enumerate(zip(word_ids, words)):
        tags = [fill] * count
        seen = set()
        for position, word in enumerate(ids):
            if word is not None and word not in seen and position < predicted.shape[1]:
                seen.add(word)
                tags[word] = int(predicted[row, position])
        rows.append(tags)
    return rows


@dataclass
class TokenClassification(LabeledTextTask):
    name: str = "token_classification"
    hub_pipeline_tag: str | None = "token-classification"

    def check_source(self, ctx: Context) -> None:
        if ctx.encoder is not None:
            ctx.encoder = WordEncoder(ctx.encoder)
        super().check_source(ctx)

    def gold_sentences(self, ctx: Context) -> list[list[int]]:
        data = ctx.evaluation_data()
        if data.items and isinstance(data.items[0], str):
            raise RecipeError(
                f"evaluate.data.field={ctx.plan.evaluate.data.field} holds text; token_classification takes "
                "word lists with one tag per word (the field of words and the label_field of tags)"
            )
        id2label = id2label_of(ctx.loaded_source().module)
        labels = self.labels_of(data)
        flat = label_ids(id2label, [tag for tags in labels for tag in tags])
        require_classes(flat, id2label, what="tag")
        sentences, start = [], 0
        for tags in labels:
            sentences.append(flat[start : start + len(tags)].tolist())
            start += len(tags)
        return sentences

    def gold_ids(self, ctx: Context) -> np.ndarray:
        return np.array([t for tags in self.gold_sentences(ctx) for t in tags], dtype=np.int64)

    def compare(self, base_logits: np.ndarray, cand_logits: np.ndarray, ctx: Context) -> dict:
        from optimize.evaluate.labeled import compare_taggers

        data = ctx.evaluation_data()
        id2label = id2label_of(ctx.loaded_source().module)
        gold = self.gold_sentences(ctx)
        if not isinstance(ctx.encoder, WordEncoder):  # check_source wraps the tokenizer's
            raise RecipeError("this model has no tokenizer: set model.tokenizer=DIR")
        word_ids = ctx.encoder.word_ids(data.items)
        label2id = {v: k for k, v in id2label.items()}
        fill = label2id.get("O", -1)
        words = [len(w) for w in data.items]
        name = lambda rows: [[id2label.get(t, "O") for t in row] for row in rows]  # noqa: E731
        compared = compare_taggers(
            name(gold),
            name(word_predictions(base_logits, word_ids, words, fill)),
            name(word_predictions(cand_logits, word_ids, words, fill)),
            self.thresholds(ctx),
        )
        compared["labeled"]["truncated_words"] = sum(
            count - len({w for w in ids if w is not None}) for ids, count in zip(word_ids, words)
        )
        return compared


register_task(TokenClassification())
