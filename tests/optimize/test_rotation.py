"""optimize/transforms/rotation.py: a decoder whose residual stream is rotated computes the same logits with every
weight matrix new (the norms' scales folded in, the embedding and LM head untied); architectures it
cannot keep exact are refused, naming what it does rotate."""

from __future__ import annotations

import pytest
import torch

from optimize.transforms.rotation import RotationError, rotate_residual
from tests.support.tiny_archs import tiny_model


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_rotated_decoder_computes_the_same_logits_with_every_matrix_new(arch):
    model = tiny_model(arch, vocab_size=512)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    difference = rotate_residual(model, seed=1)
    with torch.no_grad():
        rotated = model(input_ids=ids).logits
    assert difference <= 1e-3
    assert float((rotated - reference).abs().max()) <= 1e-3 * float(reference.std())
    after = dict(model.named_parameters())
    matrices = [n for n, p in before.items() if p.dim() == 2]
    assert matrices and not [n for n in matrices if torch.allclose(after[n], before[n], atol=1e-3)]
    # The residual stream's norms (not Qwen3's per-head q_norm and k_norm) hold their scales no more.
    residual_norms = [p for n, p in after.items() if n.endswith(("layernorm.weight", "model.norm.weight"))]
    assert residual_norms and all(float(p.min()) == float(p.max()) == 1.0 for p in residual_norms)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings is False


def test_another_seed_is_another_rotation_of_the_same_function():
    first, second = tiny_model("llama", 512), tiny_model("llama", 512)
    rotate_residual(first, seed=0), rotate_residual(second, seed=1)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.allclose(dict(first.named_parameters())[name], dict(second.named_parameters())[name])


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_an_architecture_it_cannot_keep_exact_is_refused(arch):
    """Gemma's norms after attention and MLP act on the rotated stream with their own scales; Phi-3
    fuses its projections: neither is rotated."""
    model = tiny_model(arch, vocab_size=512)
    with pytest.raises(RotationError, match=f"llama, mistral, qwen2, qwen3, not '{arch}"):
        rotate_residual(model)
