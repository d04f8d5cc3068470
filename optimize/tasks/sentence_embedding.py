"""Sentence embeddings: an encoder's last hidden state and its pooled sentence embedding, judged by
the embedding's cosine to the baseline and by retrieval agreement (top-k neighbours)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from optimize.errors import RecipeError
from optimize.tasks import register_task
from optimize.tasks.base import Task

if TYPE_CHECKING:
    from optimize.context import Context

# The encoder families the encoder recipes (minilm_int8_cpu) are tested on, each raced end to end on a
# tiny random model (tests/optimize/test_encoder_archs.py): BERT (MiniLM, BGE, E5, GTE), MPNet,
# XLM-RoBERTa, DistilBERT. Others that load as an encoder are raced too; a causal LM or an
# encoder-decoder is refused before anything is built.
TESTED_FAMILIES = ("bert", "mpnet", "xlm-roberta", "distilbert")


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

    def check_source(self, ctx: Context) -> None:
        """A decoder or an encoder-decoder has no sentence embedding to pool: one line, before any build."""
        config = getattr(ctx.loaded_source().module, "config", None)
        if config is not None and (reason := not_an_encoder(config)):
            raise RecipeError(f"model.task=sentence_embedding takes an encoder; {reason}")


def not_an_encoder(config) -> str | None:
    """Why a Hugging Face config is not a sentence encoder's (None: it is one)."""
    kind = getattr(config, "model_type", "?")
    heads = [a for a in getattr(config, "architectures", None) or [] if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if getattr(config, "is_encoder_decoder", False):
        return f"this model is an encoder-decoder (model_type={kind})"
    if getattr(config, "is_decoder", False) or heads:
        return (
            f"this model is a causal LM (model_type={kind}{', ' + heads[0] if heads else ''}): use model.task=causal_lm"
        )
    return None


register_task(SentenceEmbedding())
