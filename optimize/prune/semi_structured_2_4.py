"""2:4 sparsity: 2 of every 4 consecutive weights zeroed. The tensors stay dense, so nothing is faster
or smaller without sparse kernels (2:4 needs a GPU with sparse tensor cores)."""

from __future__ import annotations

from dataclasses import dataclass

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.prune.common import TORCH_TASKS, sparsify
from optimize.registry import register


@dataclass
class SemiStructuredConfig:
    pass


def two_four_mask(weight):
    """In every group of 4 consecutive input weights keep the 2 largest |w| (NVIDIA 2:4 pattern)."""
    rows, cols = weight.shape
    if cols % 4:
        raise RecipeError(f"2:4 sparsity needs input sizes divisible by 4 (found {cols})")
    groups = weight.abs().reshape(rows, cols // 4, 4)
    top = groups.topk(2, dim=-1).indices
    mask = groups.new_zeros(groups.shape, dtype=bool).scatter_(-1, top, True)
    return mask.reshape(rows, cols)


@register("prune", "semi_structured_2_4", SemiStructuredConfig, input_format="torch", tasks=TORCH_TASKS)
def semi_structured_2_4(model: Model, cfg: SemiStructuredConfig, ctx: Context) -> Model:
    """2:4 sparsity: 2 of every 4 weights zero (fast only with GPU sparse tensor cores)."""
    return sparsify(model, "semi_structured_2_4", two_four_mask)
