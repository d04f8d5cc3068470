"""Model surgery shared by prune and distill: where a transformer keeps its layers and projections,
and how to keep a subset of layers or slice a Linear without touching the source module."""

from __future__ import annotations

import copy

from optimize.errors import RecipeError


class Layout:
    """Where a transformer keeps its layers, attention and FFN projections."""

    def __init__(self, model):
        self.model = model
        base = getattr(model, "base_model", model)  # a classifier's encoder under its task head
        if hasattr(base, "encoder") and hasattr(base.encoder, "layer"):  # BERT family
            self.kind, self.owner, self.attr = "bert", base.encoder, "layer"
        elif hasattr(model, "model") and hasattr(model.model, "layers"):  # Llama family (ForCausalLM)
            self.kind, self.owner, self.attr = "llama", model.model, "layers"
        else:
            raise RecipeError(f"prune: {type(model).__name__} is not a BERT-style encoder or Llama-style decoder")

    @property
    def layers(self):
        return getattr(self.owner, self.attr)

    def set_layers(self, layers) -> None:
        import torch

        setattr(self.owner, self.attr, torch.nn.ModuleList(layers))

    def heads(self) -> int:
        return self.model.config.num_attention_heads

    def head_dim(self) -> int:
        config = self.model.config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def qkv(self, layer):
        if self.kind == "bert":
            s = layer.attention.self
            return s, ("query", "key", "value")
        return layer.self_attn, ("q_proj", "k_proj", "v_proj")

    def attention_out(self, layer):
        return layer.attention.output.dense if self.kind == "bert" else layer.self_attn.o_proj

    def ffn_in(self, layer):
        """(owner, names) of the Linear layers that make the FFN channels."""
        if self.kind == "bert":
            return layer.intermediate, ("dense",)
        return layer.mlp, ("gate_proj", "up_proj")

    def ffn_out(self, layer):
        return layer.output.dense if self.kind == "bert" else layer.mlp.down_proj

    def inputs(self, batch: dict) -> dict:
        import torch

        names = ("input_ids", "attention_mask") + (("token_type_ids",) if self.kind == "bert" else ())
        return {n: torch.as_tensor(batch[n]) for n in names if n in batch}


def slice_linear(linear, rows=None, cols=None):
    """A new Linear keeping output features `rows` and input features `cols` (None: all)."""
    import torch

    weight = linear.weight.detach()
    weight = weight[rows] if rows is not None else weight
    weight = weight[:, cols] if cols is not None else weight
    bias = linear.bias
    new = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    new.weight.data.copy_(weight)
    if bias is not None:
        new.bias.data.copy_(bias.detach()[rows] if rows is not None else bias.detach())
    return new


def student_copy(module):
    """A deep copy the stage may change; the source module stays the untouched teacher/baseline.
    A GGUF-loaded config carries quantization_config, which makes save_pretrained refuse: drop it."""
    student = copy.deepcopy(module)
    if hasattr(student.config, "quantization_config"):
        del student.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method", "is_quantized"):
        if attr in student.__dict__:
            delattr(student, attr)
    return student


def keep_layers(model, kept: list[int]) -> None:
    """Keep these layers, in order; decoders renumber layer_idx so the KV cache indexes match."""
    layout = Layout(model)
    layers = [layout.layers[i] for i in kept]
    for new_index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = new_index
    layout.set_layers(layers)
    config = model.config
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in kept]


def evenly_spaced(total: int, keep: int) -> list[int]:
    """`keep` layer indices spread over range(total), the first and the last always kept
    (6 -> 3: 0, 2, 5): depth pruning keeps the embedding-side and the output-side layers."""
    if keep >= total:
        return list(range(total))
    return sorted({round(j * (total - 1) / max(keep - 1, 1)) for j in range(keep)})


def parameter_count(module) -> int:
    return sum(p.numel() for p in module.parameters())
