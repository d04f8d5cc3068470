"""Adding a task is one new file plus one YAML: a task module written to a temporary directory
(appended to the `optimize.tasks` package's path, as if dropped into optimize/tasks/) and a recipe
YAML written into a copy of recipes/ are found by model.task, and the recipe runs through the whole
pipeline (export to ONNX, evaluation, gate, artifact) with nothing else naming the task."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import optimize.tasks
from optimize import pipeline, tasks
from optimize.config import register_schema
from tests.support.plugins import install_plugin

NAME = "tmp_linear"
MODULE = f"optimize.tasks.{NAME}"

TASK_FILE = '''\
"""A test task: 8x8 images flattened to 64 features, one linear layer's logits, judged by fidelity."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from optimize.context import SourceModel
from optimize.tasks import register_task
from optimize.tasks.base import Task


def flatten(items: list) -> dict[str, np.ndarray]:
    return {"features": np.stack([np.asarray(i, dtype=np.float32).reshape(-1) for i in items])}


@dataclass
class TmpLinear(Task):
    name: str = "tmp_linear"
    input_names: tuple[str, ...] = ("features",)
    output_names: tuple[str, ...] = ("logits",)
    dynamic_axes: dict = field(default_factory=lambda: {"features": {0: "batch"}})
    fidelity_output: str | None = "logits"

    def load_source(self, cfg, path: Path | None) -> SourceModel:
        import torch
        from safetensors.torch import load_file

        module = torch.nn.Linear(64, 10)
        module.load_state_dict(load_file(str(path / "model.safetensors")))
        return SourceModel("torch", cfg.task, str(path), module=module.eval())

    def module(self, model, ctx):
        """forward(features) -> logits: the exporter and the baseline pass the inputs by name."""
        import torch

        class Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = model

            def forward(self, features):
                return self.linear(features)

        return Logits().eval()

    def encoder(self, ctx):
        return flatten


register_task(TmpLinear())
'''

RECIPE_YAML = """\
# @package _global_
# The test task's linear model exported to ONNX and judged on held-out digits by output fidelity.
defaults:
  - override /calibration: digits
  - override /engine: onnx

model:
  task: tmp_linear
engine:
  params: {check_samples: 4, ort_fusions: false}
evaluate:
  data: {source: digits, split: evaluation, count: 32, seed: 1}
  batch_sizes: [1]
  latency: false
  memory: false
gate:
  min_cosine: 0.999
"""


@pytest.fixture()
def new_task(tmp_path, monkeypatch) -> Path:
    """The task file in its own directory on optimize.tasks's path, and a copy of recipes/ with the
    recipe added; returns the copy. Everything it registers is gone after the test."""
    tasks.names()  # the shipped tasks first, so the copy below holds them all
    monkeypatch.setattr(tasks, "_TASKS", dict(tasks._TASKS))  # a copy, restored afterwards
    recipes = install_plugin(tmp_path, monkeypatch, optimize.tasks, NAME, TASK_FILE)
    (recipes / "recipe" / f"{NAME}_fp32.yaml").write_text(RECIPE_YAML)
    yield recipes
    sys.modules.pop(MODULE, None)


def weights_folder(folder: Path) -> Path:
    """A model folder as the loaders expect it: config.json and safetensors weights."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"in_features": 64, "out_features": 10}))
    save_file(torch.nn.Linear(64, 10).state_dict(), str(folder / "model.safetensors"))
    return folder


def run_recipe(recipes: Path, recipe: str, tmp_path: Path) -> tuple[dict, Path]:
    """The recipe from the copy of recipes/ run in this process on a fresh weights folder."""
    source = weights_folder(tmp_path / "model")
    register_schema()
    with initialize_config_dir(config_dir=str(recipes), version_base=None):
        cfg = compose(
            "config", overrides=[f"recipe={recipe}", f"model.source={source}", f"output_dir={tmp_path / 'out'}"]
        )
    return pipeline.run(cfg, recipe, tmp_path / "run")


def test_the_new_task_is_found_by_scanning_the_package(new_task):
    assert NAME in tasks.names()
    assert tasks.get(NAME).input_names == ("features",)


def test_a_recipe_with_the_new_task_runs_through_the_pipeline(new_task, tmp_path):
    pytest.importorskip("sklearn")  # the digits data source
    manifest, artifact = run_recipe(new_task, f"{NAME}_fp32", tmp_path)
    assert manifest["gate"]["passed"], manifest["gate"]
    assert manifest["engine"]["task"] == NAME and manifest["engine"]["inputs"][0]["name"] == "features"
    fidelity = manifest["metrics"]["candidate"]["fidelity"]  # the task's fidelity_output, judged
    assert fidelity["cosine_min"] > 0.999 and fidelity["samples"] == 32
    assert (artifact / manifest["engine"]["file"]).is_file()


def test_the_race_takes_the_new_task_and_builds_its_baseline_once(new_task, tmp_path, monkeypatch):
    """engine=auto and OpenVINO take any task that does not generate; the race and the final
    evaluation compare against one baseline, and judge the winner on the size the artifact reports."""
    pytest.importorskip("sklearn")
    task_class = type(tasks.get(NAME))
    built = []
    build = task_class.baseline_runner
    monkeypatch.setattr(task_class, "baseline_runner", lambda self, *a: built.append(1) or build(self, *a))
    raced = RECIPE_YAML.replace("override /engine: onnx", "override /engine: auto").replace(
        "params: {check_samples: 4, ort_fusions: false}",
        "params: {candidates: [ort_fp32, openvino_f32], timing_repeats: 2}",
    )
    (new_task / "recipe" / f"{NAME}_auto.yaml").write_text(raced)
    manifest, _ = run_recipe(new_task, f"{NAME}_auto", tmp_path)
    race = manifest["stages"]["engine"]
    winner = next(c for c in race["candidates"] if c["name"] == race["winner"])
    assert manifest["gate"]["passed"] and {c["name"] for c in race["candidates"]} == {"ort_fp32", "openvino_f32"}
    assert winner["size_mb"] == pytest.approx(manifest["metrics"]["candidate"]["size_mb"])
    assert len(built) == 1


def test_nothing_is_left_registered_afterwards():
    """Runs after the tests above (file order): the temporary task is gone."""
    assert NAME not in tasks.names()
    assert MODULE not in sys.modules
