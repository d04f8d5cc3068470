"""The one place where methods are registered.

A method is a config dataclass plus a function, registered under (stage, name):

    @dataclass
    class Int8DynamicConfig:
        per_channel: bool = True

    @register("quantize", "ort_int8_dynamic", Int8DynamicConfig, needs_calibration=False, input_format="onnx")
    def int8_dynamic(model, cfg, ctx): ...

`refusal=` names what a method refuses before any stage runs (the recipe's op_types matching none of
the graph's nodes): the plan-time check asks each method, so it knows no method package.

The dataclass lets the whole recipe be checked before any weights load: an unknown or mistyped
parameter is a RecipeError naming the key. It is also the Hydra schema of `<stage>.params`
(see `store_schemas`), so every parameter can be overridden on the command line.

Where methods live: every module of the `optimize.quantize`, `optimize.compile`, `optimize.prune` and
`optimize.distill` packages. A new method is one new file in its package (found by
`load_plugins`) plus one YAML in recipes/<stage>/.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, get_args

from optimize.errors import RecipeError

STAGES = ("prune", "distill", "quantize", "engine")
InputFormat = Literal["torch", "onnx"]
# Every module of these packages registers methods when imported.
METHOD_PACKAGES = ("optimize.compile", "optimize.distill", "optimize.prune", "optimize.quantize")


@dataclass(frozen=True)
class Method:
    stage: str
    name: str
    config_cls: type
    fn: Callable
    needs_calibration: bool = False
    # What the method consumes: "torch" (a module, before the engine) or "onnx" (a file, after it).
    input_format: InputFormat = "onnx"
    # An engine that builds its own ONNX-side candidates (the race): no ONNX-side method may follow it.
    builds_candidates: bool = False
    # The tasks it supports: model.task names, a test the task answers (a function of the
    # optimize.tasks Task, as `takes_tensors`), or None: every task.
    tasks: tuple[str, ...] | Callable[[Any], bool] | None = None
    # What it refuses before any stage runs, from its config and the model's ONNX graph:
    # refusal(method name, config, onnx path) -> the one-line reason, or None when it can run.
    refusal: Callable[[str, Any, Path], str | None] | None = None
    # Engine methods: the engine formats (engines/formats.py names) the artifact it builds may run on,
    # or, for one that chooses among candidates (the race), a function of its config and the task.
    engine_formats: tuple[str, ...] | Callable[[Any, Any], tuple[str, ...]] = ()
    # The optional packages it cannot run without: (module to import, how to install it). Checked at
    # plan time (optimize/plan.py), before any weights load; the module itself is imported only when
    # the stage runs.
    requires: tuple[tuple[str, str], ...] = ()
    summary: str = ""

    def supports(self, task) -> bool:
        """Whether it takes `task` (an optimize.tasks Task)."""
        if self.tasks is None:
            return True
        return self.tasks(task) if callable(self.tasks) else task.name in self.tasks

    def formats(self, config, task) -> tuple[str, ...]:
        """The engine formats an engine method's artifact may run on, with `config` for `task`."""
        return self.engine_formats(config, task) if callable(self.engine_formats) else self.engine_formats

    def missing_package(self) -> str | None:
        """The one-line reason when a package it requires is not installed, else None."""
        for module, install in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a parent package that is absent or broken
                found = False
            if not found:
                return f"{self.stage}.method={self.name} needs the {module} package, which is not installed: {install}"
        return None

    def refuses(self, config, onnx_path: Path) -> str | None:
        """Why it cannot run with `config` on the graph at `onnx_path`, known before any stage runs."""
        return self.refusal(self.name, config, onnx_path) if self.refusal else None


def takes_tensors(task) -> bool:
    """Every task whose model maps named arrays to arrays (all but the generating ones): what
    OpenVINO's graph engine takes (a decoder goes to the GenAI engines instead)."""
    return not task.generates


_METHODS: dict[tuple[str, str], Method] = {}


def register(stage: str, name: str, config_cls: type, **info) -> Callable:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")

    if info.get("input_format", "onnx") not in get_args(InputFormat):
        raise ValueError(f"{stage}={name}: input_format must be one of {get_args(InputFormat)}")

    def decorate(fn: Callable) -> Callable:
        key = (stage, name)
        if key in _METHODS:
            raise ValueError(f"method {stage}={name} registered twice")
        doc = inspect.getdoc(fn)
        summary = " ".join(doc.split("\n\n")[0].split()) if doc else ""  # the docstring's first paragraph
        _METHODS[key] = Method(stage, name, config_cls, fn, summary=summary, **info)
        return fn

    return decorate


def method_modules() -> list[str]:
    """The modules whose import registers every method, packages scanned file by file."""
    found: list[str] = []
    for package_name in METHOD_PACKAGES:
        package = importlib.import_module(package_name)
        found += [f"{package_name}.{info.name}" for info in pkgutil.iter_modules(package.__path__)]
    return found


def load_plugins() -> None:
    for module in method_modules():
        importlib.import_module(module)


def all_methods() -> list[Method]:
    load_plugins()
    return list(_METHODS.values())


def store_schemas() -> None:
    """Each method's config dataclass as a Hydra structured config, `schema/<stage>/<name>`: a group
    YAML that starts with `defaults: [/schema/<stage>/<name>@_here_, _self_]` gets typed params, so
    `quantize.params.per_channel=false` is checked (and needs no `+`), and the YAML holds only what
    differs from the dataclass defaults."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for method in all_methods():
        store.store(
            group=f"schema/{method.stage}", name=method.name, node={"method": method.name, "params": method.config_cls}
        )


def get(stage: str, name: str) -> Method:
    load_plugins()
    try:
        return _METHODS[(stage, name)]
    except KeyError:
        known = ", ".join(sorted(n for s, n in _METHODS if s == stage)) or "none"
        raise RecipeError(f"{stage}.method={name!r} is not a registered method (known: {known})") from None


def names(stage: str) -> list[str]:
    load_plugins()
    return sorted(n for s, n in _METHODS if s == stage)


def build_config(method: Method, params: dict[str, Any]) -> Any:
    """Instantiate the method's config from recipe params, naming any unknown or mistyped key."""
    fields = {f.name: f for f in dataclasses.fields(method.config_cls)}
    hints = typing.get_type_hints(method.config_cls)
    for key, value in params.items():
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise RecipeError(f"{method.stage}.params.{key} is not a parameter of {method.name} (known: {known})")
        _check_type(f"{method.stage}.params.{key}", value, hints[key])
    config = method.config_cls(**params)
    validate = getattr(config, "validate", None)
    if validate:
        validate()
    return config


def _check_type(key: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    allowed = typing.get_args(hint) if origin is typing.Union else (hint,)
    for expected in allowed:
        if expected is type(None) and value is None:
            return
        base = typing.get_origin(expected) or expected
        if base is Any or base is typing.Literal and value in typing.get_args(expected):
            return
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if isinstance(base, type) and base is not type(None) and isinstance(value, base):
            if not (base is int and isinstance(value, bool)):
                return
    raise RecipeError(f"{key}={value!r} has the wrong type (expected {hint})")
