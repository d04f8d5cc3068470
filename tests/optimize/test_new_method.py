"""Adding a quantize method is one new file plus one YAML: a method module written to a temporary
directory (appended to the `optimize.quantize` package's path, as if dropped into optimize/quantize/)
and a group YAML written into a copy of recipes/ are found, typed on the command line, and planned."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import optimize.quantize
from optimize import pipeline, registry
from optimize.config import register_schema
from tests.support.plugins import install_plugin

NAME = "tmp_identity"
MODULE = f"optimize.quantize.{NAME}"

METHOD_FILE = '''\
from dataclasses import dataclass

from optimize.errors import RecipeError
from optimize.registry import register


@dataclass
class TmpIdentityConfig:
    bits: int = 8
    scale: float = 1.0
    note: str = "as is"

    def validate(self):
        if self.bits not in (4, 8):
            raise RecipeError(f"quantize.params.bits={self.bits} (use 4 or 8)")


@register("quantize", "tmp_identity", TmpIdentityConfig, input_format="onnx")
def tmp_identity(model, cfg, ctx):
    """Returns the ONNX model unchanged (a test method)."""
    return model.recorded({"method": "tmp_identity", "bits": cfg.bits})
'''

GROUP_YAML = """\
# A test method: only what differs from TmpIdentityConfig's defaults.
defaults:
  - /schema/quantize/tmp_identity@_here_
  - _self_

method: tmp_identity
params:
  scale: 0.5
"""


@pytest.fixture()
def new_method(tmp_path, monkeypatch) -> Path:
    """The method file in its own directory on optimize.quantize's path, and a copy of recipes/ with
    the YAML added; returns the copy. Everything it registers is gone after the test."""
    registry.load_plugins()  # the shipped methods first, so the copy below holds them all
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))  # a copy, restored afterwards
    recipes = install_plugin(tmp_path, monkeypatch, optimize.quantize, NAME, METHOD_FILE)
    (recipes / "quantize" / f"{NAME}.yaml").write_text(GROUP_YAML)
    yield recipes
    sys.modules.pop(MODULE, None)
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().repo.get("schema", {}).get("quantize", {}).pop(f"{NAME}.yaml", None)


def compose_with(recipes: Path, *overrides: str):
    register_schema()  # stores every method's schema, the new one included
    with initialize_config_dir(config_dir=str(recipes), version_base=None):
        return compose("config", overrides=["recipe=minilm_int8_cpu", "engine=onnx", f"quantize={NAME}", *overrides])


def test_the_new_module_is_found_by_scanning_the_package(new_method):
    assert MODULE in registry.method_modules()
    assert NAME in registry.names("quantize")
    method = registry.get("quantize", NAME)
    assert method.input_format == "onnx" and method.summary.startswith("Returns the ONNX model unchanged")


def test_its_params_are_typed_and_overridable_without_plus(new_method, tmp_path):
    cfg = compose_with(new_method, "quantize.params.bits=4")
    assert cfg.quantize.method == NAME
    assert cfg.quantize.params.bits == 4
    assert cfg.quantize.params.scale == 0.5  # from the YAML
    assert cfg.quantize.params.note == "as is"  # from the dataclass
    with pytest.raises(Exception, match="bits"):
        compose_with(new_method, "quantize.params.bits=four")  # not an int: refused at composition
    with pytest.raises(Exception, match="bogus"):
        compose_with(new_method, "quantize.params.bogus=1")  # not a field: refused too (without +)


def test_the_pipeline_plans_a_recipe_that_uses_it(new_method, tmp_path):
    cfg = compose_with(new_method, "quantize.params.bits=4", f"output_dir={tmp_path / 'out'}")
    plan = pipeline.plan(cfg, tmp_path)
    configs = {method.name: config for method, config in plan.stages}
    assert [m.name for m, _ in pipeline.order(plan.stages)] == ["onnx", NAME]
    assert configs[NAME].bits == 4 and configs[NAME].scale == 0.5
    from optimize.errors import RecipeError

    with pytest.raises(RecipeError, match="quantize.params.bits=5"):  # the method's own validate() runs
        pipeline.plan(compose_with(new_method, "quantize.params.bits=5"), tmp_path)


def test_nothing_is_left_registered_afterwards():
    """Runs after the tests above (file order): the temporary method is gone."""
    assert NAME not in registry.names("quantize")
    assert MODULE not in sys.modules
