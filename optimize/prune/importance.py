"""Activation-based importance for structured pruning, as in NVIDIA Minitron (arXiv 2407.14679):
- a layer's importance is 1 - cos(its input, its output) averaged over tokens (block importance):
  a layer that barely turns its input is the cheapest to drop;
- a head's importance is the mean L2 norm of its attention output (before the output projection);
- an FFN channel's importance is the mean |activation| entering the down projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optimize.transforms.surgery import Layout

if TYPE_CHECKING:
    import torch


def collect_importance(model, batches: list[dict]) -> dict:
    """One pass over calibration batches with hooks: per-layer block importance, per-head and
    per-channel activation magnitudes (summed over tokens, then averaged)."""
    import torch

    layout = Layout(model)
    head_dim = layout.head_dim()
    sums = {"heads": [0.0] * len(layout.layers), "ffn": [0.0] * len(layout.layers)}
    hooks = []

    def on_attention_input(i):
        def hook(_module, args):
            x = args[0].detach().float()  # [B, T, heads * head_dim]
            norms = x.reshape(*x.shape[:-1], -1, head_dim).norm(dim=-1)  # [B, T, heads]
            sums["heads"][i] = sums["heads"][i] + norms.reshape(-1, norms.shape[-1]).mean(0)

        return hook

    def on_ffn_input(i):
        def hook(_module, args):
            x = args[0].detach().float()
            sums["ffn"][i] = sums["ffn"][i] + x.abs().reshape(-1, x.shape[-1]).mean(0)

        return hook

    for i, layer in enumerate(layout.layers):
        hooks.append(layout.attention_out(layer).register_forward_pre_hook(on_attention_input(i)))
        hooks.append(layout.ffn_out(layer).register_forward_pre_hook(on_ffn_input(i)))
    block = torch.zeros(len(layout.layers))
    try:
        with torch.inference_mode():
            for batch in batches:
                out = model(**layout.inputs(batch), output_hidden_states=True)
                block += _block_importance(out.hidden_states, batch.get("attention_mask"))
    finally:
        for hook in hooks:
            hook.remove()
    n = len(batches)
    return {
        "layers": (block / n).tolist(),
        "heads": [h / n for h in sums["heads"]],
        "ffn": [f / n for f in sums["ffn"]],
    }


def _block_importance(hidden_states, mask) -> "torch.Tensor":
    """1 - mean cosine(input of layer i, output of layer i) over real tokens, per layer."""
    import torch

    scores = []
    weights = torch.as_tensor(mask).float() if mask is not None else None
    for before, after in zip(hidden_states[:-1], hidden_states[1:]):
        cos = torch.nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)  # [B, T]
        mean = (cos * weights).sum() / weights.sum() if weights is not None else cos.mean()
        scores.append(1 - mean)
    return torch.stack(scores)
