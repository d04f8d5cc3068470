"""Scoring a bf16 checkpoint in its own precision where that pays on this CPU: the measurement that
chooses it, the runner's switch (FP32 stays the default and stays exact), and the standard tasks'
choice as a recipe sets it."""

from __future__ import annotations

import numpy as np
import pytest

from engines.pytorch import half_compute


@pytest.fixture(scope="module")
def bf16_runner(tmp_path_factory):
    import torch

    from engines.pytorch.runner import TorchLM
    from tests.support.models import train_tokenizer
    from tests.support.tiny_archs import tiny_model

    out = tmp_path_factory.mktemp("bf16")
    return TorchLM(tiny_model("llama", train_tokenizer(out)).to(torch.bfloat16))


def test_the_typical_weight_is_the_most_common_linear_shape_not_the_largest():
    import torch

    layers = [torch.nn.Linear(8, 16) for _ in range(3)] + [torch.nn.Linear(8, 64)]
    model = torch.nn.Sequential(*layers)
    assert tuple(half_compute.typical_weight(model).shape) == (16, 8)
    assert half_compute.typical_weight(torch.nn.Sequential(torch.nn.ReLU())) is None


def test_an_fp32_model_is_computed_in_fp32_without_a_measurement():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert half_compute.held_precision(model) == "float32"
    assert half_compute.half_compute_speedup(model) == 1.0
    assert half_compute.faster_precision(model) == ("float32", 1.0)


def test_a_bf16_model_is_computed_in_bf16_only_where_it_measured_faster(bf16_runner):
    chosen, speedup = half_compute.faster_precision(bf16_runner.model)
    assert speedup > 0
    assert chosen == ("bfloat16" if speedup >= half_compute.WORTH_IT else "float32")


def test_scores_are_fp32_by_default_and_in_bf16_only_within_scored_in(bf16_runner):
    import torch

    ids = list(range(1, 48))
    exact = bf16_runner.logits(ids)
    with torch.inference_mode():
        fp32_model = _fp32_copy(bf16_runner.model)
        reference = fp32_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    assert np.array_equal(exact, reference)  # the default: the FP32 model's scores, bit for bit
    with bf16_runner.scored_in("bfloat16"):
        rounded = bf16_runner.logits(ids)
        choices = bf16_runner.continuation_logprobs(ids[:20], [ids[20:25], ids[20:30]])
    assert not np.array_equal(rounded, exact) and np.allclose(rounded, exact, atol=0.1)
    assert all(np.isfinite(c).all() for c in choices)
    assert bf16_runner.scores_in == "float32" and np.array_equal(bf16_runner.logits(ids), exact)


def test_a_precision_the_weights_are_not_held_in_is_refused(bf16_runner):
    with pytest.raises(ValueError, match="held in bfloat16 cannot be scored in float16"):
        with bf16_runner.scored_in("float16"):
            pass


@pytest.mark.parametrize("speedup, chosen", [(3.8, "bfloat16"), (1.1, "float32")])
def test_the_standard_tasks_precision_follows_the_setting_and_the_measurement(
    bf16_runner, monkeypatch, speedup, chosen
):
    from optimize.tasks.lm_fidelity import task_precision

    # What an AVX-512 BF16 CPU measured at Llama-3.2-1B's shape (3.8x), and an AVX2-only one's order.
    monkeypatch.setattr(half_compute, "half_compute_speedup", lambda model: speedup)
    assert task_precision(bf16_runner, "auto", "baseline") == chosen
    assert task_precision(bf16_runner, "float32", "baseline") == "float32"
    assert task_precision(object(), "auto", "candidate") is None  # not a PyTorch model: scored as served


def test_an_unknown_task_precision_is_a_recipe_error():
    from optimize.errors import RecipeError
    from optimize.tasks.causal_lm import LLMEvalConfig

    with pytest.raises(RecipeError, match="task_precision: auto or float32"):
        LLMEvalConfig(lm_eval_tasks=[], task_precision="bf16").validate()


def _fp32_copy(model):
    import copy

    import torch

    return copy.deepcopy(model).to(torch.float32).eval()


def test_the_report_says_when_the_baseline_answered_its_tasks_in_its_held_precision():
    from optimize.reports.console import baseline_lines

    said = "the checkpoint /m in bfloat16 (PyTorch), scored in FP32 a module at a time, generating in bfloat16"
    metrics = {"baseline": {"reference": {"statement": said}}, "candidate": {"standard_tasks": {}}}
    metrics["candidate"]["standard_tasks"]["scored_in"] = {"baseline": "bfloat16", "candidate": None}
    assert baseline_lines(metrics) == [f"baseline: {said}; its standard tasks answered in bfloat16, faster here"]
    metrics["candidate"]["standard_tasks"]["scored_in"]["baseline"] = "float32"
    assert baseline_lines(metrics) == [f"baseline: {said}"]
