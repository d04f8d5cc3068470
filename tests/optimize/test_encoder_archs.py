"""Sentence encoders of the architecture families the encoder recipe takes (BERT, MPNet, XLM-RoBERTa,
DistilBERT) through `recipe=minilm_int8_cpu` on tiny random models: every candidate of the default set
built within its budget, scored and gated; a causal LM or an encoder-decoder refused in one line."""

from __future__ import annotations

import json

import pytest

from optimize.tasks.sentence_embedding import TESTED_FAMILIES, not_an_encoder
from tests.support.cli import one_error_line, run_optimize
from tests.support.tiny_archs import ENCODERS, encoder_folder


def test_the_tested_families_are_the_tiny_models_built_here():
    assert set(TESTED_FAMILIES) == set(ENCODERS)


def test_a_decoder_or_an_encoder_decoder_is_not_an_encoder():
    import transformers

    for arch in ENCODERS:
        assert not_an_encoder(transformers.AutoConfig.for_model(arch)) is None
    llama = transformers.LlamaConfig(architectures=["LlamaForCausalLM"])
    assert (
        not_an_encoder(llama)
        == "this model is a causal LM (model_type=llama, LlamaForCausalLM): use model.task=causal_lm"
    )
    assert not_an_encoder(transformers.T5Config()) == "this model is an encoder-decoder (model_type=t5)"


def test_a_causal_lm_given_to_the_encoder_recipe_is_refused_in_one_line(tmp_path):
    from tests.support.tiny_archs import tiny_folder

    source = tiny_folder("llama", tmp_path / "llama")
    proc = run_optimize(
        "recipe=minilm_int8_cpu",
        f"model.source={source}",
        f"output_dir={tmp_path / 'out'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_error_line(proc, "model.task=sentence_embedding takes an encoder", "causal LM (model_type=llama")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ENCODERS))
def test_the_default_recipe_races_and_gates_each_encoder_family(arch, tmp_path):
    source = encoder_folder(arch, tmp_path / "src")
    out = tmp_path / "artifact"
    proc = run_optimize(
        "recipe=minilm_int8_cpu",
        f"model.source={source}",
        "evaluate.data.count=32",
        "calibration.count=16",
        "evaluate.repeats=2",
        "evaluate.warmup=1",
        "evaluate.retimes=0",  # no speed gated; the other test worker shares the machine
        "evaluate.memory=false",
        "engine.params.timing_repeats=2",
        "gate.min_speedup=null",  # a speed bar is untrusted on a shared machine; accuracy is the point here
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    race = json.loads((out / "manifest.json").read_text())["stages"]["engine"]
    assert race["budget"]["cut"] == []
    timing = race["timing"]  # the timing phase ran under its own budget, twice the longest build's
    assert timing["budget_s"] == 2 * max(race["budget"]["per_candidate_s"].values()) and timing["spent_s"] > 0
    for candidate in race["candidates"]:
        if candidate["precision"] is not None:  # built: within its budget (plus the 10% the race allows)
            assert candidate["build_s"] <= 1.1 * candidate["budget_s"], candidate
        else:  # not built here (no bf16 on this CPU): said why, never an error
            assert candidate["outcome"].startswith(("not built:", "refused")), candidate
            assert "Error" not in candidate["outcome"], candidate
    winner = next(c for c in race["candidates"] if c["name"] == race["winner"])
    assert winner["passed_accuracy"]
