"""The plan: the recipe resolved once into typed values, and the only reader of the raw recipe besides
the entry point (no stage, method or task reads `ctx.cfg`)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from optimize import pipeline, workload
from optimize.config import recipe_dict
from optimize.errors import RecipeError
from optimize.plan import Plan
from tests.support.context import compose_recipe, recipe_context

OPTIMIZE = Path(__file__).resolve().parents[2] / "optimize"
# The entry point composes the recipe and hands it to the pipeline; the plan module resolves it.
RECIPE_READERS = {"__main__.py", "plan.py"}


def context_recipe_reads(source: str) -> list[int]:
    """Lines that read `.cfg` from a context: `ctx.cfg`, `context.cfg`, `self.ctx.cfg`."""
    reads = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or node.attr != "cfg":
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name in ("ctx", "context"):
            reads.append(node.lineno)
    return sorted(reads)


def test_the_scan_finds_a_context_reading_the_recipe():
    source = "def f(ctx, self):\n  a = ctx.cfg.evaluate\n  b = self.ctx.cfg\n  c = context.cfg.gate\n  d = cfg.gate\n"
    assert context_recipe_reads(source) == [2, 3, 4]


def test_no_stage_method_or_task_reads_the_recipe_from_its_context():
    found = {
        f"{path.relative_to(OPTIMIZE.parent)}:{line}"
        for path in sorted(OPTIMIZE.rglob("*.py"))
        if path.relative_to(OPTIMIZE).as_posix() not in RECIPE_READERS
        for line in context_recipe_reads(path.read_text())
    }
    assert not found, f"read the plan (ctx.plan) instead of the recipe: {sorted(found)}"


def test_the_context_has_no_recipe_field():
    from optimize.context import Context

    assert "cfg" not in {f.name for f in dataclasses.fields(Context)}


def test_the_plan_holds_the_recipe_resolved_and_is_frozen(tmp_path):
    overrides = ("evaluate.batch_sizes=[1,8]", "evaluate.top_k=3", "model.max_length=64", "gate.min_cosine=0.97")
    cfg = compose_recipe(*overrides, f"output_dir={tmp_path / 'out'}")
    plan = pipeline.plan(cfg, tmp_path)
    assert isinstance(plan, Plan)
    assert plan.task.name == cfg.model.task == plan.model.task
    assert plan.evaluate.batch_sizes == (1, 8) and plan.evaluate.top_k == 3 and plan.model.max_length == 64
    assert dict(plan.gate) == recipe_dict(cfg.gate) and plan.gate["min_cosine"] == 0.97
    assert plan.evaluate.data.split == "evaluation" and plan.calibration.source == cfg.calibration.source
    assert plan.workload == workload.resolve(cfg)
    assert [m.stage for m, _ in plan.stages] == ["engine"] and plan.final_dir == tmp_path / "out"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.evaluate = plan.evaluate  # type: ignore[misc]


def test_the_workload_is_resolved_once_per_plan(tmp_path, monkeypatch):
    calls = []
    real = workload.resolve
    monkeypatch.setattr(workload, "resolve", lambda cfg, **kw: calls.append(1) or real(cfg, **kw))
    ctx = recipe_context(tmp_path, "workload.batches=[1,4]")
    assert len(calls) == 1
    assert [p.batch for p in ctx.plan.workload.batches] == [1, 4]


def test_the_distill_stage_records_the_prune_section_as_the_recipe_has_it(tmp_path):
    cfg = compose_recipe("prune=structured", "prune.params.layers_ratio=0.5", f"output_dir={tmp_path / 'out'}")
    plan = pipeline.plan(cfg, tmp_path)
    from omegaconf import OmegaConf

    assert plan.prune.record() == OmegaConf.to_container(cfg.prune, resolve=True)


def test_the_context_loads_its_data_from_the_plan(tmp_path):
    ctx = recipe_context(tmp_path, "calibration=random", "calibration.shape=[4]", "calibration.count=6")
    data = ctx.calibration()
    assert data.source == "random" and len(data.items) == 6 and data.items[0].shape == (4,)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("serve.max_batch_size=0", "serve.max_batch_size: must be > 0"),
        ("serve.max_queue=-3", "serve.max_queue: must be > 0"),
        ("serve.timeout_s=nan", "serve.timeout_s"),
        ("serve.max_queue_delay_ms=-1", "serve.max_queue_delay_ms: must be >= 0"),
    ],
)
def test_serve_settings_are_checked_at_plan_time_as_the_server_checks_its_flags(override, fragment, tmp_path):
    from serve.__main__ import build_parser

    with pytest.raises(RecipeError, match=fragment):
        pipeline.plan(compose_recipe(override, f"output_dir={tmp_path / 'out'}"), tmp_path)
    # the server refuses the same value as a flag, with the same words
    key, value = override.split("=")
    flag = "--" + key.split(".")[1].replace("_", "-")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["artifact", flag, value])
    assert exited.value.code == 2


@pytest.mark.parametrize(
    "override",
    [
        "distill=logit_hidden_kd",
        "engine=auto",
    ],
)
def test_nan_and_inf_are_refused_wherever_a_number_goes(override, tmp_path):
    bad = {
        "distill=logit_hidden_kd": ["distill.params.lr=inf", "distill.params.temperature=nan"],
        "engine=auto": ["engine.params.time_budget_s=nan", "+engine.params.candidate_budget_s.ort_fp32=inf"],
    }[override]
    for value in [*bad, "gate.min_cosine=nan"]:
        with pytest.raises(RecipeError, match="give a finite number") as err:
            pipeline.plan(compose_recipe(override, value, f"output_dir={tmp_path / 'out'}"), tmp_path)
        assert value.lstrip("+").split("=")[0] in str(err.value)


def test_a_manifest_is_json_whatever_a_metric_measured(tmp_path):
    import json

    from optimize import artifact

    stage = tmp_path / "stage"
    stage.mkdir()
    written = artifact.write_manifest(stage, {"metrics": {"candidate": {"loss": float("nan"), "p95": float("inf")}}})
    assert written["metrics"]["candidate"] == {"loss": None, "p95": None}
    json.loads((stage / "manifest.json").read_text(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
