"""`serve.structured_output=true`: the artifact must serve constrained output, so the plan refuses an
engine method whose engine format cannot constrain (read from the engine classes' `honours`), and the
race refuses, before building, the candidates that cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import formats
from optimize import pipeline, registry, tasks
from optimize.compile.race import budget as race_budget
from optimize.compile.race import candidates
from optimize.compile.race.entry import Entry
from optimize.errors import RecipeError
from tests.support.cli import one_error_line, run_optimize
from tests.support.context import compose_recipe


class _Unconstrained:
    honours = ("top_k",)


class _Constrained:
    honours = ("constraint", "top_k")


def load_unconstrained(root, engine, threads=0, spinning=True) -> _Unconstrained:
    return _Unconstrained()


def load_constrained(root, engine, settings, threads=0, spinning=True) -> _Constrained:
    return _Constrained()


def test_a_format_constrains_output_when_every_engine_class_it_serves_with_honours_a_constraint():
    assert set(formats.constraining()) == {formats.ONNXRUNTIME_GENAI, formats.OPENVINO_GENAI}
    for name in formats.FORMATS:
        row = formats.get(name)
        if row.serves != "causal_lm":
            assert not row.constrains_output, name  # encoders and formats serve/ does not run
            continue
        classes = [row.loaded_class(), row.batch_class()]
        assert row.constrains_output == all("constraint" in cls.honours for cls in classes if cls), name
    here = f"{__name__}:"
    batched_only = formats.EngineFormat(
        "x", here + "load_unconstrained", (), "causal_lm", "continuous", here + "load_constrained"
    )
    assert not batched_only.constrains_output  # --max-num-seqs 1 would serve it unconstrained
    both = formats.EngineFormat("x", here + "load_unconstrained", (), "causal_lm")
    assert not both.constrains_output
    assert formats.EngineFormat("x", here + "load_constrained", (), "encoder").constrains_output is False


def test_every_engine_method_declares_the_formats_it_builds():
    llm, encoder = tasks.get("causal_lm"), tasks.get("sentence_embedding")
    for method in registry.all_methods():
        if method.stage != "engine":
            continue
        for task in (llm, encoder):
            if not method.supports(task):
                continue
            config = method.config_cls()
            made = method.formats(config, task)
            assert made, f"engine.method={method.name} declares no engine_formats"
            assert set(made) <= set(formats.FORMATS), (method.name, made)
    race = registry.get("engine", "auto")
    assert set(race.formats(candidates.EngineRaceConfig(), llm)) == {formats.ONNXRUNTIME_GENAI, formats.OPENVINO_GENAI}
    assert formats.ONNXRUNTIME in race.formats(candidates.EngineRaceConfig(), encoder)


def _plan(tmp_path: Path, *overrides: str):
    cfg = compose_recipe(*overrides, f"output_dir={tmp_path / 'out'}")
    return pipeline.plan(cfg, tmp_path)


@pytest.mark.parametrize("engine", ["auto", "genai_int4", "openvino_genai_int4"])
def test_a_generating_engine_that_constrains_is_planned(tmp_path, engine):
    plan = _plan(tmp_path, "recipe=smollm2_int4_cpu", f"engine={engine}", "serve.structured_output=true")
    assert plan.serve.structured_output is True
    assert _plan(tmp_path, "recipe=smollm2_int4_cpu", f"engine={engine}").serve.structured_output is False


def test_an_engine_that_cannot_constrain_is_refused_naming_the_key_and_the_engine(tmp_path):
    overrides = ("recipe=smollm2_int4_cpu", "quantize=modelopt_fp8", "engine=modelopt_checkpoint")
    _plan(tmp_path, *overrides)  # plans without the key
    with pytest.raises(RecipeError) as refused:
        _plan(tmp_path, *overrides, "serve.structured_output=true")
    line = str(refused.value)
    assert "serve.structured_output=true" in line and "engine.method=modelopt_checkpoint" in line
    assert "modelopt-torch" in line and "\n" not in line


@pytest.mark.slow  # the command line
def test_the_command_line_refusal_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_optimize("recipe=minilm_int8_cpu", "serve.structured_output=true", f"output_dir={out}")
    one_error_line(proc, "serve.structured_output=true", "engine.method=auto", "onnxruntime", "openvino")
    assert not out.exists()


def test_the_race_refuses_candidates_that_cannot_constrain_before_building():
    names = ["ort_genai_int4", "ort_fp32", "openvino_genai_int8", "openvino_int8"]
    entries = [Entry(name, candidates.CANDIDATES[name]) for name in names]
    race_budget.refuse_unconstrained(entries, tasks.get("causal_lm"))
    refused = {e.name: e.outcome for e in entries if e.refused}
    assert set(refused) == {"ort_fp32", "openvino_int8"}
    assert "serve.structured_output=true" in refused["ort_fp32"] and "onnxruntime" in refused["ort_fp32"]
    assert refused["openvino_int8"].startswith("refused at plan time:")
    line = race_budget.fewer_than_asked(entries)  # nothing built: all four are missing
    assert line is not None and "refused at plan time: ort_fp32, openvino_int8" in line
