"""What the prune methods share: the tasks they take and zeroing weights in place (the sparsity methods)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from optimize.context import Model
from optimize.errors import RecipeError
from optimize.transforms.surgery import Layout, student_copy

log = logging.getLogger(__name__)
TORCH_TASKS = ("sentence_embedding", "causal_lm", "text_classification", "token_classification")
NO_SPEEDUP_NOTE = (
    "weights are zeroed but stored dense: no time or size is saved without sparse kernels "
    "(2:4 needs a GPU with sparse tensor cores, e.g. NVIDIA Ampere or newer)"
)


def sparse_targets(module) -> list:
    """Linear layers inside the transformer blocks (embeddings and the LM head are left dense)."""
    import torch

    layout = Layout(module)
    return [m for layer in layout.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def sparsify(model: Model, method: str, make_mask: Callable) -> Model:
    """The model with every weight of its blocks' Linear layers zeroed where make_mask(weight) is False."""
    import torch

    if model.kind != "torch":
        raise RecipeError(f"prune.method={method} needs a PyTorch model (not an ONNX source)")
    student = student_copy(model.module)
    zeros = total = 0
    with torch.no_grad():
        for linear in sparse_targets(student):
            mask = make_mask(linear.weight)
            linear.weight.mul_(mask)
            zeros += int((~mask).sum())
            total += mask.numel()
    log.warning("prune %s: %s", method, NO_SPEEDUP_NOTE)
    return dataclasses.replace(model, module=student).recorded(
        {
            "method": method,
            "zeroed_weights": zeros,
            "of": total,
            "sparsity": round(zeros / max(total, 1), 4),
            "note": NO_SPEEDUP_NOTE,
        }
    )
