"""Sentence embeddings: an encoder's last hidden state and its pooled sentence embedding, judged by
the embedding's cosine to the baseline and by retrieval agreement (top-k neighbours)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from optimize.tasks import register_task
from optimize.tasks.base import Task

if TYPE_CHECKING:
    from optimize.context import Context


@dataclass
class SentenceEmbedding(Task):
    name: str = "sentence_embedding"
    hub_pipeline_tag: str | None = "sentence-similarity"
    input_names: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")
    output_names: tuple[str, ...] = ("last_hidden_state", "sentence_embedding")
    dynamic_axes: dict = field(
        default_factory=lambda: {
            n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask", "token_type_ids")
        }
    )
    fidelity_output: str | None = "sentence_embedding"
    distill_loss: str | None = "embedding"

    def module(self, model, ctx: Context):
        from engines.pytorch.runner import sentence_embedding_module

        return sentence_embedding_module(model, ctx.pooling)


register_task(SentenceEmbedding())
