"""The real optimize.context.Context for method and task tests, built as a run builds it: a recipe
composed from recipes/ (the overrides on top of the default preset), checked and resolved by
`pipeline.plan`, and a Context on that plan. What a test gives itself instead of a download or a
model folder is the source, the encoder and the calibration items:

    recipe_context(tmp_path, source=torch_source(teacher), items=TEXTS)    # prune and distill
    onnx_context(tmp_path, count=32, width=64)                              # quantize methods on an MLP
    recipe_context(tmp_path, "calibration.count=4", encoder=TextEncoder(folder))  # real CPython text
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from calibration import TextSet
from optimize import pipeline
from optimize.config import register_schema
from optimize.context import Context, SourceModel
from tests.support.models import encode

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def compose_recipe(*overrides: str):
    """The recipe `python -m optimize OVERRIDES...` would run, composed in this process."""
    from hydra import compose, initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose("config", overrides=list(overrides))


def recipe_context(
    scratch: Path,
    *overrides: str,
    source: SourceModel | None = None,
    encoder: Callable | None = encode,
    items: list | None = None,
    threads: int = 1,
) -> Context:
    """The Context a run of the composed recipe hands its stages. `items`: the calibration set, made
    by the test (kept in its order) in place of the recipe's calibration source."""
    scratch = Path(scratch)
    cfg = compose_recipe(*overrides, f"output_dir={scratch / 'artifact'}")
    plan = pipeline.plan(cfg, scratch)
    drawn = None
    if items is not None:
        drawn = TextSet(source="test", split="calibration", seed=0, items=list(items), available=len(items))
    return Context(plan, scratch, source=source, encoder=encoder, threads=threads, _calibration=drawn)


def torch_source(module, scratch: Path, task: str = "sentence_embedding") -> SourceModel:
    """A PyTorch module as the pipeline loads a Hugging Face source (the teacher of prune and distill)."""
    return SourceModel("hf", task, str(Path(scratch) / "teacher"), module=module)


def onnx_context(
    scratch: Path, *overrides: str, count: int = 32, width: int = 64, items: list | None = None
) -> Context:
    """Calibration items that are float vectors, encoded as the input `x` of a [batch, width] model."""
    if items is None:
        items = [np.random.default_rng(i).standard_normal(width).astype(np.float32) for i in range(count)]
    return recipe_context(scratch, *overrides, items=items, encoder=lambda rows: {"x": np.stack(rows)})


def torch_context(module, scratch: Path, task: str = "sentence_embedding") -> Context:
    """A PyTorch source (the teacher), the stand-in tokenizer, the shared texts as calibration, and a
    structured-prune recipe (what the distill stage records of the pruning before it)."""
    from tests.support.models import TEXTS

    pruned = ("prune=structured", "prune.params.layers_ratio=0.5")
    return recipe_context(scratch, *pruned, source=torch_source(module, scratch, task), items=TEXTS)
