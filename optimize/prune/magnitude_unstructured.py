"""Unstructured magnitude sparsity: zeroes the smallest weights. The tensors stay dense, so nothing is
faster or smaller without sparse kernels."""

from __future__ import annotations

from dataclasses import dataclass

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.prune.common import TORCH_TASKS, sparsify
from optimize.registry import register


@dataclass
class MagnitudeConfig:
    sparsity: float = 0.5  # fraction of each Linear weight set to zero (smallest |w| first)

    def validate(self):
        if not 0 <= self.sparsity < 1:
            raise RecipeError(f"prune.params.sparsity={self.sparsity}: use a fraction in [0, 1)")


def magnitude_mask(weight, sparsity: float):
    """True where |w| is above the `sparsity` quantile of the tensor."""
    k = int(weight.numel() * sparsity)
    if k == 0:
        return weight.new_ones(weight.shape, dtype=bool)
    threshold = weight.abs().flatten().kthvalue(k).values
    return weight.abs() > threshold


@register("prune", "magnitude_unstructured", MagnitudeConfig, input_format="torch", tasks=TORCH_TASKS)
def magnitude_unstructured(model: Model, cfg: MagnitudeConfig, ctx: Context) -> Model:
    """Zero the smallest-magnitude weights of each Linear (no speedup without sparse kernels)."""
    return sparsify(model, "magnitude_unstructured", lambda w: magnitude_mask(w, cfg.sparsity))
