"""Every recipe composes against the schema and passes the pre-flight check, so a renamed key or
a broken preset fails here, not in a user's hands."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from optimize import pipeline
from optimize.__main__ import CONFIG_DIR
from optimize.config import register_schema
from optimize.errors import RecipeError

RECIPES = sorted(p.stem for p in (Path(CONFIG_DIR) / "recipe").glob("*.yaml"))
# Recipes that need hardware this machine may not have refuse in the pre-flight check by design.
NEEDS_GPU = ("_gpu", "_trt")


def compose_recipe(name: str, *overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose("config", overrides=[f"recipe={name}", *overrides])


def test_there_is_a_default_recipe():
    assert "minilm_int8_cpu" in RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_plans(name, tmp_path):
    cfg = compose_recipe(name, f"output_dir={tmp_path / 'out'}")
    try:
        plan = pipeline.plan(cfg, tmp_path)
    except RecipeError as exc:
        assert any(tag in name for tag in NEEDS_GPU), f"{name}: {exc}"
        return
    assert plan.final_dir == (tmp_path / "out").resolve()
    assert any(method.stage == "engine" for method, _ in plan.stages)


def test_default_recipe_resolves_the_expected_stages(tmp_path):
    cfg = compose_recipe("minilm_int8_cpu")
    plan = pipeline.plan(cfg, tmp_path)
    assert [m.name for m, _ in pipeline.order(plan.stages)] == ["onnx", "ort_int8_dynamic"]
    assert plan.needs_calibration
    assert plan.final_dir == tmp_path / "artifact"
    assert cfg.gate.min_speedup == 1.5 and cfg.gate.min_cosine == 0.99


def test_overrides_reach_every_setting(tmp_path):
    cfg = compose_recipe("minilm_int8_cpu", "gate.min_speedup=2.0", "evaluate.batch_sizes=[1,8]",
                         "quantize.params.max_fp32_nodes=2")
    assert cfg.gate.min_speedup == 2.0
    assert list(cfg.evaluate.batch_sizes) == [1, 8]
    plan = pipeline.plan(cfg, tmp_path)
    quantize_cfg = dict((m.name, c) for m, c in plan.stages)["ort_int8_dynamic"]
    assert quantize_cfg.max_fp32_nodes == 2


@pytest.mark.parametrize("overrides, message", [
    (["gate.min_cosine=null", "gate.min_mean_cosine=null", "gate.min_topk_agreement=null",
      "gate.min_speedup=null"], "the gate checks nothing"),
    (["quantize.method=int3"], "quantize.method='int3' is not a registered method"),
    (["+quantize.params.bogus=1"], "quantize.params.bogus is not a parameter of ort_int8_dynamic"),
    (["engine.method=none"], "engine.method is required"),
    (["evaluate.batch_sizes=[]"], "evaluate.batch_sizes"),
    (["model.task=speech"], "model.task=speech is not supported"),
    (["evaluate.overlap=ignore"], "evaluate.overlap=ignore"),
    (["evaluate.data.count=8"], "more than the 8 evaluation samples"),
])
def test_plan_refuses_bad_recipes(overrides, message, tmp_path):
    cfg = compose_recipe("minilm_int8_cpu", *overrides)
    with pytest.raises(RecipeError, match=message):
        pipeline.plan(cfg, tmp_path)
