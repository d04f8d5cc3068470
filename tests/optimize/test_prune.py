"""Prune methods on tiny random BERT and Llama models: shapes shrink, outputs stay finite, the
result still exports, the teacher is untouched, and impossible targets are recipe errors."""

from __future__ import annotations

import pytest

from optimize.errors import RecipeError
from optimize.prune.magnitude_unstructured import magnitude_unstructured
from optimize.prune.semi_structured_2_4 import semi_structured_2_4
from optimize.prune.structured import structured as prune_structured
from optimize.registry import build_config, get
from optimize.transforms import surgery
from tests.support.context import torch_context
from tests.support.models import encode, tiny_bert, tiny_llama, torch_model


def structured(module, tmp_path, task="sentence_embedding", **params):
    ctx = torch_context(module, tmp_path)
    cfg = build_config(get("prune", "structured"), dict(params, calibration_samples=16))
    return prune_structured(torch_model(module, task), cfg, ctx), ctx


def bert_outputs(module, texts=("a b c", "d e f g")):
    import torch

    batch = {k: torch.as_tensor(v) for k, v in encode(list(texts)).items()}
    with torch.no_grad():
        return module(**batch).last_hidden_state


@pytest.mark.slow
def test_structured_bert_shrinks_depth_heads_and_ffn_and_exports(tmp_path):
    import numpy as np

    from engines.onnxruntime.export import export
    from engines.onnxruntime.runner import OrtRunner
    from engines.pytorch.runner import sentence_embedding_module

    teacher = tiny_bert()
    out, ctx = structured(teacher, tmp_path, layers=2, heads=2, ffn_ratio=0.5)
    student = out.module
    assert len(student.encoder.layer) == 2 and len(teacher.encoder.layer) == 4  # the teacher is untouched
    layer = student.encoder.layer[0]
    assert layer.attention.self.query.out_features == 16 and layer.attention.output.dense.in_features == 16
    assert layer.intermediate.dense.out_features == 32 and layer.output.dense.in_features == 32
    assert bool(bert_outputs(student).isfinite().all())
    record = out.record
    assert len(record["removed"]["layers"]) == 2 and record["parameters"]["after"] < record["parameters"]["before"]
    assert all(len(heads) == 2 for heads in record["removed"]["heads"].values())
    wrapped = sentence_embedding_module(student, {"mode": "mean", "normalize": True})
    inputs = encode(["one two", "three four five"])
    path = export(
        wrapped,
        inputs,
        ["last_hidden_state", "sentence_embedding"],
        tmp_path / "m.onnx",
        {n: {0: "batch", 1: "sequence"} for n in inputs},
        18,
    )
    onnx_out = OrtRunner(path)(inputs)["sentence_embedding"]
    assert onnx_out.shape == (2, 32) and np.isfinite(onnx_out).all()


@pytest.mark.slow
def test_structured_llama_drops_layers_and_ffn_and_saves(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    teacher = tiny_llama()
    out, ctx = structured(teacher, tmp_path, task="causal_lm", layers=2, ffn=24)
    student = out.module
    assert len(student.model.layers) == 2 and student.config.num_hidden_layers == 2
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1]  # KV cache slots renumbered
    assert student.model.layers[1].mlp.down_proj.in_features == 24
    ids = torch.tensor([[5, 6, 7, 8]])
    logits = student(input_ids=ids).logits
    assert logits.shape == (1, 4, 100) and bool(logits.isfinite().all())
    student.save_pretrained(tmp_path / "saved")  # what the GenAI builder reads
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.allclose(reloaded(input_ids=ids).logits, student.eval()(input_ids=ids).logits, atol=1e-5)


def test_more_heads_than_exist_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="only 4 attention heads"):
        structured(tiny_bert(), tmp_path, heads=5)


def test_more_layers_than_exist_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="only 4 layers"):
        structured(tiny_bert(), tmp_path, layers=9)


def test_head_pruning_of_a_decoder_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="prune layers or ffn"):
        structured(tiny_llama(), tmp_path, task="causal_lm", heads=2)


@pytest.mark.parametrize(
    "params, message",
    [
        ({}, "needs a target"),
        ({"layers": 2, "layers_ratio": 0.5}, "not both"),
        ({"ffn_ratio": 1.5}, "in \\(0, 1\\]"),
        ({"heads": 0}, "at least 1"),
    ],
)
def test_bad_targets_fail_before_weights_load(params, message):
    with pytest.raises(RecipeError, match=message):
        build_config(get("prune", "structured"), params)


def test_magnitude_unstructured_zeroes_the_requested_share(tmp_path):
    teacher = tiny_bert()
    ctx = torch_context(teacher, tmp_path)
    cfg = build_config(get("prune", "magnitude_unstructured"), {"sparsity": 0.6})
    out = magnitude_unstructured(torch_model(teacher), cfg, ctx)
    student = out.module
    weight = student.encoder.layer[0].intermediate.dense.weight
    assert abs(float((weight == 0).float().mean()) - 0.6) < 0.02
    assert float((teacher.encoder.layer[0].intermediate.dense.weight == 0).float().mean()) == 0
    assert bool(bert_outputs(student).isfinite().all())
    assert "no time or size is saved" in out.record["note"]


def test_semi_structured_2_4_keeps_two_of_every_four(tmp_path):
    teacher = tiny_llama()
    ctx = torch_context(teacher, tmp_path)
    out = semi_structured_2_4(torch_model(teacher, "causal_lm"), None, ctx)
    student = out.module
    weight = student.model.layers[0].mlp.up_proj.weight
    nonzero_per_group = (weight != 0).reshape(weight.shape[0], -1, 4).sum(-1)
    assert int(nonzero_per_group.max()) <= 2
    assert out.record["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert "2:4 needs a GPU" in out.record["note"]


def test_evenly_spaced_layer_selection_keeps_first_and_last(tmp_path):
    out, ctx = structured(tiny_bert(), tmp_path, layers=3, layer_selection="evenly_spaced")
    assert out.record["kept_layers"] == [0, 2, 3]  # round(0, 1.5, 3)
    assert len(out.module.encoder.layer) == 3


@pytest.mark.parametrize("make, task", [(tiny_bert, "sentence_embedding"), (tiny_llama, "causal_lm")])
def test_output_fidelity_selection_drops_the_layer_that_matters_least(tmp_path, make, task):
    """Greedy choice is checked against brute force: with one layer to drop, the kept set must be the
    one whose final hidden states are closest to the full model's."""
    import torch

    teacher = make()
    out, ctx = structured(teacher, tmp_path, task=task, layers=3, layer_selection="output_fidelity")
    kept = out.record["kept_layers"]
    layout = surgery.Layout(teacher)
    full = list(layout.layers)
    batch = {k: torch.as_tensor(v) for k, v in encode(ctx.calibration().items[:16]).items()}
    inputs = layout.inputs(batch)
    extra = {"use_cache": False} if task == "causal_lm" else {}

    def final(layers):
        layout.set_layers(layers)
        with torch.no_grad():
            return teacher(**inputs, output_hidden_states=True, **extra).hidden_states[-1]

    reference = final(full)
    mask = batch["attention_mask"].float()

    def kept_score(drop: int) -> float:
        others = [layer for i, layer in enumerate(full) if i != drop]
        return float((torch.cosine_similarity(final(others), reference, dim=-1) * mask).sum() / mask.sum())

    score = {drop: kept_score(drop) for drop in range(len(full))}
    layout.set_layers(full)
    assert [i for i in range(len(full)) if i not in kept] == [max(score, key=score.get)]
    assert len(out.module.encoder.layer if task != "causal_lm" else out.module.model.layers) == 3


def test_unknown_layer_selection_is_a_recipe_error():
    with pytest.raises(RecipeError, match="layer_selection=random"):
        build_config(get("prune", "structured"), {"layers": 2, "layer_selection": "random"})
