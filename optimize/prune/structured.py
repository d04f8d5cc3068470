"""Structured pruning: smaller dense models. Removes whole layers (depth), attention heads and FFN
channels (width), ranked by activations on calibration data as in NVIDIA Minitron (importance.py).
The result is an ordinary (smaller) Hugging Face model that exports through the same engines.
Layouts known: BERT-style encoders (BertModel and relatives) and Llama-style decoders.

Example recipe (MiniLM, 6 -> 3 layers):

    prune:
      method: structured
      params: {layers: 3, calibration_samples: 32}
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.prune.common import TORCH_TASKS
from optimize.prune.importance import collect_importance
from optimize.registry import register
from optimize.transforms.surgery import Layout, evenly_spaced, keep_layers, parameter_count, slice_linear, student_copy

log = logging.getLogger(__name__)
LAYER_SELECTIONS = ("block_importance", "output_fidelity", "evenly_spaced")


@dataclass
class StructuredPruneConfig:
    """Targets are what is KEPT: exact sizes (layers, heads per layer, FFN channels) or fractions."""

    layers: Optional[int] = None
    heads: Optional[int] = None  # attention heads kept per layer (BERT-style encoders)
    ffn: Optional[int] = None  # FFN channels (intermediate size) kept per layer
    layers_ratio: Optional[float] = None
    heads_ratio: Optional[float] = None
    ffn_ratio: Optional[float] = None
    # Which layers go: block_importance (Minitron: the layers that turn their input least),
    # output_fidelity (greedy: drop the layer whose removal keeps the final hidden states closest to
    # the full model's; one forward pass per candidate, so meant for small models) or evenly_spaced.
    layer_selection: str = "block_importance"
    calibration_samples: int = 32  # calibration texts scored for importance
    batch_size: int = 8

    def validate(self):
        for exact, ratio in (("layers", "layers_ratio"), ("heads", "heads_ratio"), ("ffn", "ffn_ratio")):
            value, fraction = getattr(self, exact), getattr(self, ratio)
            if value is not None and fraction is not None:
                raise RecipeError(f"prune.params: set {exact} or {ratio}, not both")
            if value is not None and value < 1:
                raise RecipeError(f"prune.params.{exact}={value}: keep at least 1")
            if fraction is not None and not 0 < fraction <= 1:
                raise RecipeError(f"prune.params.{ratio}={fraction}: the fraction kept must be in (0, 1]")
        targets = ("layers", "heads", "ffn", "layers_ratio", "heads_ratio", "ffn_ratio")
        if all(getattr(self, k) is None for k in targets):
            raise RecipeError("prune.method=structured needs a target: layers, heads, ffn or a *_ratio")
        if self.calibration_samples < 1 or self.batch_size < 1:
            raise RecipeError("prune.params.calibration_samples and batch_size must be at least 1")
        if self.layer_selection not in LAYER_SELECTIONS:
            raise RecipeError(
                f"prune.params.layer_selection={self.layer_selection} (use {', '.join(LAYER_SELECTIONS)})"
            )

    def target(self, name: str, total: int) -> int:
        """Units kept out of `total`; a target above what exists is a recipe error."""
        exact, fraction = getattr(self, name), getattr(self, name + "_ratio")
        kept = exact if exact is not None else total if fraction is None else max(1, round(fraction * total))
        if kept > total:
            what = {"layers": "layers", "heads": "attention heads per layer", "ffn": "FFN channels per layer"}[name]
            raise RecipeError(f"prune.params.{name}={kept}, but the model has only {total} {what}")
        return kept


@register("prune", "structured", StructuredPruneConfig, input_format="torch", needs_calibration=True, tasks=TORCH_TASKS)
def structured(model: Model, cfg: StructuredPruneConfig, ctx: Context) -> Model:
    """Remove layers, attention heads and FFN channels ranked by calibration activations (Minitron)."""
    if model.kind != "torch":
        raise RecipeError("prune.method=structured needs a PyTorch model (not an ONNX source)")
    student = student_copy(model.module).eval()
    layout = Layout(student)
    targets = {
        "layers": cfg.target("layers", len(layout.layers)),
        "heads": cfg.target("heads", layout.heads()),
        "ffn": cfg.target("ffn", student.config.intermediate_size),
    }
    if targets["heads"] < layout.heads() and layout.kind != "bert":
        raise RecipeError(
            "prune.params.heads: head pruning supports BERT-style encoders; for Llama-style "
            "decoders (grouped KV heads) prune layers or ffn"
        )
    before = parameter_count(student)
    batches = calibration_batches(ctx, cfg)
    scores = collect_importance(student, batches)
    kept_layers = choose_layers(student, cfg.layer_selection, scores["layers"], batches, targets["layers"])
    removed: dict[str, object] = {"layers": [i for i in range(len(scores["layers"])) if i not in kept_layers]}
    keep_layers(student, kept_layers)
    removed["heads"] = prune_heads(student, [scores["heads"][i] for i in kept_layers], targets["heads"])
    removed["ffn_channels"] = prune_ffn(student, [scores["ffn"][i] for i in kept_layers], targets["ffn"])
    log.info("structured prune: %s -> %d parameters (was %d)", targets, parameter_count(student), before)
    return dataclasses.replace(model, module=student, kept_layers=kept_layers).recorded(
        {
            "method": "structured",
            "targets": targets,
            "layer_selection": cfg.layer_selection,
            "kept_layers": kept_layers,
            "removed": removed,
            "layer_importance": [round(s, 5) for s in scores["layers"]],
            "parameters": {"before": before, "after": parameter_count(student)},
        }
    )


def calibration_batches(ctx: Context, cfg: StructuredPruneConfig) -> list[dict]:
    texts = ctx.calibration().items[: cfg.calibration_samples]
    return [ctx.encode(texts[i : i + cfg.batch_size]) for i in range(0, len(texts), cfg.batch_size)]


def choose_layers(model, selection: str, importance: list[float], batches: list[dict], keep: int) -> list[int]:
    """Indices of the layers kept, in order."""
    total = len(importance)
    if keep >= total:
        return list(range(total))
    if selection == "evenly_spaced":
        return evenly_spaced(total, keep)
    if selection == "output_fidelity":
        return _greedy_output_fidelity(model, batches, keep)
    ranked = sorted(range(total), key=lambda i: importance[i], reverse=True)
    return sorted(ranked[:keep])


def _greedy_output_fidelity(model, batches: list[dict], keep: int) -> list[int]:
    """Drop layers one at a time, each time the one whose removal leaves the final hidden states
    closest (mean token cosine over calibration batches) to the full model's."""
    import torch

    layout = Layout(model)
    layers = list(layout.layers)
    extra = {"use_cache": False} if layout.kind == "llama" else {}

    def final_states():
        with torch.inference_mode():
            return [
                model(**layout.inputs(b), output_hidden_states=True, **extra).hidden_states[-1].float() for b in batches
            ]

    def fidelity(states, reference) -> float:
        total, count = 0.0, 0.0
        for got, want, batch in zip(states, reference, batches):
            cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
            mask = (
                torch.as_tensor(batch["attention_mask"]).float() if "attention_mask" in batch else torch.ones_like(cos)
            )
            total, count = total + float((cos * mask).sum()), count + float(mask.sum())
        return total / count

    reference = final_states()
    kept = list(range(len(layers)))
    try:
        while len(kept) > keep:
            scores = {}
            for candidate in kept:
                layout.set_layers([layers[i] for i in kept if i != candidate])
                scores[candidate] = fidelity(final_states(), reference)
            drop = max(scores, key=lambda layer: scores[layer])
            log.info("prune: layer %d dropped (final hidden-state cosine %.4f)", drop, scores[drop])
            kept.remove(drop)
    finally:
        layout.set_layers(layers)
    return kept


def prune_heads(model, importance: list, keep: int) -> dict:
    """Keep the `keep` strongest heads in every layer (the same count everywhere, so the config
    stays uniform): slice q/k/v output rows and the output projection's input columns."""
    layout = Layout(model)
    if keep >= layout.heads():
        return {}
    head_dim, removed = layout.head_dim(), {}
    for i, (layer, scores) in enumerate(zip(layout.layers, importance)):
        heads = sorted(scores.argsort(descending=True)[:keep].tolist())
        rows = [h * head_dim + d for h in heads for d in range(head_dim)]
        owner, names = layout.qkv(layer)
        for name in names:
            setattr(owner, name, slice_linear(getattr(owner, name), rows=rows))
        layer.attention.output.dense = slice_linear(layout.attention_out(layer), cols=rows)
        owner.num_attention_heads, owner.all_head_size = keep, keep * head_dim
        removed[i] = [h for h in range(layout.heads()) if h not in heads]
    model.config.num_attention_heads = keep
    return removed


def prune_ffn(model, importance: list, keep: int) -> dict:
    """Keep the `keep` most active FFN channels per layer: rows of the up (and gate) projections,
    columns of the down projection."""
    layout = Layout(model)
    total = model.config.intermediate_size
    if keep >= total:
        return {}
    for layer, scores in zip(layout.layers, importance):
        channels = sorted(scores.argsort(descending=True)[:keep].tolist())
        owner, names = layout.ffn_in(layer)
        for name in names:
            setattr(owner, name, slice_linear(getattr(owner, name), rows=channels))
        _set_ffn_out(layout, layer, slice_linear(layout.ffn_out(layer), cols=channels))
    model.config.intermediate_size = keep
    return {"per_layer": total - keep, "of": total}


def _set_ffn_out(layout, layer, linear) -> None:
    if layout.kind == "bert":
        layer.output.dense = linear
    else:
        layer.mlp.down_proj = linear
