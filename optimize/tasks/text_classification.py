"""Text classification (sentiment, intent, topic): a Hugging Face AutoModelForSequenceClassification
judged on labeled text, gated on the accuracy and macro-F1 drop in points against PyTorch FP32.

    model: {source: DIR_OR_HUB_ID, task: text_classification}
    evaluate:
      data: {source: labeled, path: eval.jsonl, field: text, label_field: label, dataset_split: all}
    gate: {max_accuracy_drop: 0.5, max_f1_drop: 1.0, min_prediction_agreement: 0.98}

The graph takes input_ids, attention_mask and token_type_ids and returns logits [batch, labels].
Labels in the data are names from the model's id2label or its integer ids (checked before any stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from optimize.tasks import register_task
from optimize.tasks.labeled_text import LabeledTextTask, id2label_of, label_ids, require_classes

if TYPE_CHECKING:
    from optimize.context import Context


@dataclass
class TextClassification(LabeledTextTask):
    name: str = "text_classification"
    hub_pipeline_tag: str | None = "text-classification"

    def gold_ids(self, ctx: Context) -> np.ndarray:
        data = ctx.evaluation_data()
        if data.items and not isinstance(data.items[0], str):
            from optimize.errors import RecipeError

            raise RecipeError(
                f"evaluate.data.field={ctx.plan.evaluate.data.field} holds word lists; text_classification takes "
                "one text per example (word lists with one tag per word are model.task=token_classification)"
            )
        id2label = id2label_of(ctx.loaded_source().module)
        ids = label_ids(id2label, list(self.labels_of(data)))
        require_classes(ids, id2label)
        return ids

    def compare(self, base_logits: np.ndarray, cand_logits: np.ndarray, ctx: Context) -> dict:
        from optimize.evaluate.labeled import compare_classifiers

        return compare_classifiers(
            self.gold_ids(ctx), base_logits.argmax(-1), cand_logits.argmax(-1), self.thresholds(ctx)
        )


register_task(TextClassification())
