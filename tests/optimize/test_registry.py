from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from optimize import registry
from optimize.errors import RecipeError


@dataclass
class DemoConfig:
    bits: int = 8
    scale: float = 1.0
    name: Optional[str] = None
    layers: List[str] = field(default_factory=list)

    def validate(self):
        if self.bits not in (4, 8):
            raise RecipeError(f"bits={self.bits}")


def _demo(model, cfg, ctx):
    """Demo method."""
    return model


def _method(name="demo"):
    return registry.Method("quantize", name, DemoConfig, _demo)


def test_builtin_methods_are_registered_once_and_found_by_name():
    assert "ort_int8_dynamic" in registry.names("quantize")
    assert "onnx" in registry.names("engine")
    method = registry.get("quantize", "ort_int8_dynamic")
    assert method.stage == "quantize" and method.input_format == "onnx" and method.summary


def test_unknown_method_names_the_stage_and_known_methods():
    with pytest.raises(RecipeError, match=r"quantize.method='int3_magic'.*ort_int8_dynamic"):
        registry.get("quantize", "int3_magic")


def test_registering_a_name_twice_is_refused(monkeypatch):
    # A copy of the registry, restored afterwards: a method left registered would show in the docs tables
    # of every later test in this process (tests/optimize/test_docs_tables.py).
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    registry.register("prune", "test_twice", DemoConfig)(_demo)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("prune", "test_twice", DemoConfig)(_demo)


def test_register_rejects_unknown_stage():
    with pytest.raises(ValueError, match="unknown stage"):
        registry.register("bake", "x", DemoConfig)


def test_build_config_accepts_valid_params_and_int_for_float():
    config = registry.build_config(_method(), {"bits": 4, "scale": 2, "layers": ["a"], "name": None})
    assert config == DemoConfig(bits=4, scale=2, layers=["a"])


@pytest.mark.parametrize(
    "params, message",
    [
        ({"bitz": 4}, r"quantize.params.bitz is not a parameter of demo \(known: bits, scale, name, layers\)"),
        ({"bits": "four"}, r"quantize.params.bits='four' has the wrong type"),
        ({"bits": True}, r"quantize.params.bits=True has the wrong type"),
        ({"layers": "a"}, r"quantize.params.layers='a' has the wrong type"),
        ({"bits": 3}, r"bits=3"),
    ],
)
def test_build_config_names_the_bad_key(params, message):
    with pytest.raises(RecipeError, match=message):
        registry.build_config(_method(), params)
