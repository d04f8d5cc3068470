"""The generation interface's settings: a Sampling field an engine cannot honour is refused by name,
never ignored, and the defaults ask for nothing."""

from __future__ import annotations

import pytest

from engines.generation import Constraint, Sampling, UnsupportedSampling, refuse_unhonoured


def test_the_defaults_ask_for_nothing():
    assert Sampling(8, temperature=0.7, top_p=0.9, seed=3).asked() == []


@pytest.mark.parametrize(
    "field, sampling",
    [
        ("constraint", Sampling(8, constraint=Constraint("regex", "[0-9]+"))),
        ("logprobs", Sampling(8, logprobs=True)),
        ("top_logprobs", Sampling(8, top_logprobs=5)),
        ("n", Sampling(8, n=2)),
    ],
)
def test_an_unhonoured_field_is_refused_by_name(field, sampling):
    with pytest.raises(UnsupportedSampling, match=f"Sampling.{field}") as refused:
        refuse_unhonoured(sampling, "some-engine")
    assert refused.value.field == field
    refuse_unhonoured(sampling, "some-engine", honours=(field,))  # an engine that honours it takes it


def test_openvino_genai_refuses_before_it_builds_a_generation_config():
    from engines.openvino.genai_runner import OVGenAIRunner

    runner = object.__new__(OVGenAIRunner)  # no model needed: the refusal comes first
    with pytest.raises(UnsupportedSampling, match="openvino-genai cannot honour Sampling.n"):
        runner.generation_config(4, Sampling(8, n=3))


def test_openvino_genai_draws_a_fresh_seed_for_an_unseeded_sampled_request():
    """Its pipeline's default rng_seed is one fixed number: left there, every unseeded request of a
    prompt would sample the same text."""
    ov_genai = pytest.importorskip("openvino_genai")
    from engines.openvino.genai_runner import OVGenAIRunner

    runner = object.__new__(OVGenAIRunner)
    runner.default_config = ov_genai.GenerationConfig
    runner.eos_token_ids, runner.context_length = {2}, 128
    seeds = {runner.generation_config(4, Sampling(8, temperature=1.0)).rng_seed for _ in range(4)}
    assert len(seeds) == 4
    assert runner.generation_config(4, Sampling(8, temperature=1.0, seed=7)).rng_seed == 7
