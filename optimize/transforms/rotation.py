"""Rotate a decoder's residual stream by a random orthogonal matrix: the same function in FP32, with
every weight matrix a new one.

For a pre-norm decoder (Llama, Mistral, Qwen2, Qwen3) whose RMSNorm scales are first folded into the
matrices that read the normed stream, RMSNorm(x Q) = RMSNorm(x) Q for any orthogonal Q (it keeps the
norm). So the model computes the same logits with the embedding E Q, every matrix that reads the
stream (q, k, v, gate, up, the LM head) W Q, and every matrix that writes it (o, down) Q^T W. This is
QuaRot's and SpinQuant's residual rotation without their online Hadamards: the result is still a plain
model of the same architecture, which any engine runs.

What it is for here: each new weight mixes hundreds of old ones, so a model dequantized from a 4-bit
file (whose weights sit on that file's grid of blocks) becomes a full-precision model of the same
function and perplexity with no grid under it, a source on which INT4 methods can be compared from
full precision offline. A rotation also spreads the residual stream's outlier channels over all
channels, which favours INT4: a comparison on it says which method is better on such a model, not
how much a model trained in full precision loses.
"""

from __future__ import annotations

from typing import Any

# The decoder layer's parts this rotation knows: the norms before attention and MLP, the matrices that
# read the normed stream, and those that write the stream.
READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
WRITERS = ("self_attn.o_proj", "mlp.down_proj")
NORMS = {"input_layernorm": READERS[:3], "post_attention_layernorm": READERS[3:]}
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Largest logit difference (relative to the logits' spread) accepted as the same function in FP32.
TOLERANCE = 1e-3


class RotationError(ValueError):
    """The model is not one this rotation keeps the function of."""


def rotate_residual(model: Any, seed: int = 0) -> float:
    """Rotate `model` (a transformers causal LM, FP32) in place; returns the largest logit difference
    against the model before, over the logits' spread, on a fixed sequence of token ids. Ties the
    embedding and the LM head apart (they are rotated with different norm scales). RotationError for an
    architecture or a layer this rotation does not keep the function of."""
    import torch

    kind = getattr(model.config, "model_type", "")
    if kind not in ARCHITECTURES:
        raise RotationError(f"a residual rotation is kept exact for {', '.join(ARCHITECTURES)}, not {kind!r}")
    ids = torch.arange(1, 65).remainder(model.config.vocab_size).unsqueeze(0)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        _untie(model)
        _fold_norms(model)
        q = _random_orthogonal(model.config.hidden_size, seed)
        _apply(model, q)
        after = model(input_ids=ids).logits
    spread = float(before.std())
    difference = float((after - before).abs().max()) / spread
    if not difference <= TOLERANCE:  # NaN fails too
        raise RotationError(f"the rotated model's logits differ by {difference:.2g} of their spread")
    return difference


def _untie(model: Any) -> None:
    import torch

    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def _fold_norms(model: Any) -> None:
    """Each RMSNorm's scale into the matrices reading its output (W diag(g)), the scale then 1."""
    decoder = model.model
    for layer in decoder.layers:
        for norm_name, readers in NORMS.items():
            _fold(getattr(layer, norm_name), [layer.get_submodule(r) for r in readers])
    _fold(decoder.norm, [model.get_output_embeddings()])


def _fold(norm: Any, readers: list) -> None:
    for linear in readers:
        linear.weight.mul_(norm.weight.unsqueeze(0))
    norm.weight.fill_(1.0)


def _random_orthogonal(size: int, seed: int):
    """A Haar-random orthogonal matrix (QR of a Gaussian, signs fixed), float64 for the products."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _apply(model: Any, q) -> None:
    """E Q, readers W Q, writers Q^T W (their biases b Q), products in float64."""
    embedding = model.get_input_embeddings()
    _set(embedding.weight, embedding.weight.double() @ q)
    readers = [model.get_output_embeddings()]
    writers = []
    for layer in model.model.layers:
        readers += [layer.get_submodule(r) for r in READERS]
        writers += [layer.get_submodule(w) for w in WRITERS]
    for linear in readers:
        _set(linear.weight, linear.weight.double() @ q)
    for linear in writers:
        _set(linear.weight, q.T @ linear.weight.double())
        if linear.bias is not None:
            _set(linear.bias, linear.bias.double() @ q)


def _set(parameter, value) -> None:
    parameter.copy_(value.to(parameter.dtype))
