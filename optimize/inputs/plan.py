"""The plan of a tensor model's inputs: shapes, dtypes and values from the recipe, never guessed.

`model.inputs.NAME` sets, per input, a shape (a string dim such as N stands for the batch), a dtype,
a constant `value` (a sample rate, a zero state), and the range of random data (`low`/`high`, or
`mean`/`std`). The rules for a graph's symbolic dims, in order:
1. the recipe's `model.inputs.NAME.shape`;
2. the batch: the first dim of the data input, and every dim of any input with the same symbol;
3. the ONNX model's metadata_props, when it has an integer entry named after the symbol;
4. otherwise one line naming the input and dim and the override to set (never a silent default).
A dim the recipe gives is a positive whole number or a name (the batch); every input's dims are
bounded so that one sample of it fits a CPU run (MAX_ITEM_ELEMENTS).

The data input (the one calibration and evaluation items feed) is the first input without a
constant `value`; items are stacked along a new batch axis. Every other input is its constant,
or random data from its spec seeded per batch.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

import numpy as np

from optimize.errors import RecipeError

# ONNX element types the recipe may name, as numpy dtypes.
DTYPES = {
    "float32": np.float32,
    "float": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "double": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}
BATCH = "N"
# Elements of one sample of one input (the batch dims left out): 2**26 is 256 MiB of float32, so a
# batch of 32 of them still fits in a CPU machine's memory; beyond it numpy fails to allocate.
MAX_ITEM_ELEMENTS = 2**26
# A name in a shape is the batch; "..." or "64" in quotes is a placeholder or a typo, not a name.
SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
# The value the advice puts where a symbolic dim has none: an example for the user to replace.
EXAMPLE_DIM = 64


@dataclass
class InputPlan:
    """One input resolved: its dims (int, or BATCH), dtype, and where its values come from."""

    name: str
    dims: list  # int | BATCH | None (a symbolic dim that the data decides)
    dtype: Any
    value: float | None
    spec: dict

    def shape(self, batch: int) -> list[int]:
        unresolved = [i for i, d in enumerate(self.dims) if d is None]
        if unresolved:
            symbol = self.spec.get("_symbols", {}).get(unresolved[0], "?")
            example = [EXAMPLE_DIM if d is None else d for d in self.dims]
            raise RecipeError(
                f"model input {self.name!r} dim {unresolved[0]} is symbolic ({symbol}) and nothing sets it: "
                f"add {shape_override(self.name, example)} with your sizes in place of {EXAMPLE_DIM} "
                f"(a string dim such as {BATCH} is the batch)"
            )
        return [batch if d == BATCH else d for d in self.dims]

    def describe(self) -> str:
        dims = ",".join(_dim_text(d) for d in self.dims)
        return f"{self.name}[{dims}] {np.dtype(self.dtype).name}"


def _dim_text(dim) -> str:
    if dim is None:
        return "?"
    # Past int64 a dim is absurd, and Python refuses to print an int of over 4300 digits.
    return "beyond int64" if isinstance(dim, int) and dim.bit_length() > 63 else str(dim)


def _shape_text(dims: list) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def shape_override(name: str, dims: list) -> str:
    """The command-line override that sets an input's shape, quoted for a shell. `++` adds the key or
    replaces it, so the same words work whether the recipe sets model.inputs.NAME or not. A name
    with a dot or a colon (input.1, onnx::Conv_0) is a key of a mapping, escaped as Hydra reads it;
    each form is kept only if Hydra's own parser reads it back as this name and shape."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    shape = _shape_text(dims)
    key = re.sub(r"([\\()\[\]{}:=, ])", r"\\\1", name)
    parser = OverridesParser.create()
    forms: list[tuple[str, tuple[str, Any]]] = []
    if "." not in name:  # a dotted key would nest: input.1 -> {input: {1: ...}}
        forms.append((f"++model.inputs.{name}.shape={shape}", (f"model.inputs.{name}.shape", dims)))
    forms.append((f"++model.inputs={{{key}:{{shape:{shape}}}}}", ("model.inputs", {name: {"shape": dims}})))
    for text, wanted in forms:
        try:
            override = parser.parse_override(text)
        except HydraException:  # the parser raises it for every form it cannot read
            continue
        if (override.key_or_group, override.value()) == wanted:
            return shlex.quote(text)
    return f"shape: {shape} under model.inputs[{name!r}] in a recipe (Hydra cannot take this name on the command line)"


def plan_inputs(signature: list[dict], given: dict, metadata: dict[str, str]) -> list[InputPlan]:
    """Resolve every input of a signature ({name, type, shape}) with the recipe's `model.inputs`."""
    names = [s["name"] for s in signature]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise RecipeError(f"model.inputs names {unknown}, which the model does not take (it takes {names})")
    for name, spec in given.items():
        _check_spec_keys(name, spec)
    data_input = next((s["name"] for s in signature if (given.get(s["name"]) or {}).get("value") is None), None)
    batch_symbol = None
    if data_input is not None:
        first = next(s for s in signature if s["name"] == data_input)["shape"]
        batch_symbol = first[0] if first and not isinstance(first[0], int) else None
    plans = [
        _plan_one(s, given.get(s["name"]) or {}, batch_symbol, metadata, s["name"] == data_input) for s in signature
    ]
    for plan in plans:
        _check_item_size(plan)
    return plans


def _check_spec_keys(name: str, spec) -> None:
    from dataclasses import fields

    from optimize.config import InputSpec

    known = {f.name for f in fields(InputSpec)}
    if not isinstance(spec, dict):
        raise RecipeError(f"model.inputs.{name} must be a mapping of {sorted(known)}, got {spec!r}")
    unknown = sorted(set(spec) - known)
    if unknown:
        raise RecipeError(f"model.inputs.{name} has unknown keys {unknown} (known: {', '.join(sorted(known))})")


def _plan_one(spec: dict, given: dict, batch_symbol, metadata: dict[str, str], feeds_data: bool) -> InputPlan:
    name, model_dims = spec["name"], list(spec["shape"])
    dtype = _dtype(given.get("dtype"), spec["type"], name)
    if given.get("shape") is not None:
        fixed = _recipe_dims(name, given["shape"])
        if len(fixed) != len(model_dims):
            raise RecipeError(
                f"model.inputs.{name}.shape has {len(fixed)} dims, "
                f"the model's input has {len(model_dims)} ({model_dims})"
            )
        for i, (mine, theirs) in enumerate(zip(fixed, model_dims)):
            if isinstance(theirs, int) and isinstance(mine, int) and mine != theirs:
                raise RecipeError(
                    f"model.inputs.{name}.shape dim {i} is {_dim_text(mine)}, the model fixes it at {theirs}"
                )
        return InputPlan(name, fixed, dtype, given.get("value"), dict(given, _model_dims=model_dims))
    dims: list = []
    symbols = {}
    for i, d in enumerate(model_dims):
        if isinstance(d, int):
            dims.append(d)
        elif d is not None and d == batch_symbol or (feeds_data and i == 0):
            dims.append(BATCH)
        elif isinstance(d, str) and _metadata_dim(metadata, d) is not None:
            dims.append(_metadata_dim(metadata, d))
        else:
            dims.append(None)  # the data decides it (data input) or the recipe must (others)
            symbols[i] = d
    return InputPlan(name, dims, dtype, given.get("value"), dict(given, _symbols=symbols, _model_dims=model_dims))


def _recipe_dims(name: str, shape) -> list:
    """The recipe's shape as dims: positive ints, and BATCH for a name. Anything else is refused
    here, before numpy sees it: a fraction would be truncated, a negative or huge dim fail to allocate."""
    if not isinstance(shape, (list, tuple)):
        raise RecipeError(f"model.inputs.{name}.shape={shape!r} (give a list of dims, such as [{BATCH},3,224,224])")
    dims: list = []
    for i, d in enumerate(shape):
        if isinstance(d, str) and SYMBOL.fullmatch(d):
            dims.append(BATCH)
        elif isinstance(d, int) and not isinstance(d, bool) and d >= 1:
            dims.append(d)
        else:
            given = _dim_text(d) if isinstance(d, int) else repr(d)
            raise RecipeError(
                f"model.inputs.{name}.shape dim {i} is {given}: a dim is a positive whole number, "
                f"or a name such as {BATCH} for the batch"
            )
    return dims


def _metadata_dim(metadata: dict[str, str], symbol: str) -> int | None:
    """A symbol's value from the model's metadata_props: a positive integer, or nothing."""
    text = str(metadata.get(symbol, "")).strip()
    return int(text) if re.fullmatch(r"[0-9]{1,19}", text) and int(text) > 0 else None


def _check_item_size(plan: InputPlan) -> None:
    """One sample of the input must fit a CPU run, whichever of the recipe, the graph or the model's
    metadata set its dims (Python ints do not overflow, so the product is exact)."""
    elements = 1
    for i, d in enumerate(plan.dims):
        if isinstance(d, int):
            elements *= d
            if elements > MAX_ITEM_ELEMENTS:
                raise RecipeError(
                    f"model input {plan.name!r} dim {i} is {_dim_text(d)}: one sample of {plan.describe()} "
                    f"would hold over {MAX_ITEM_ELEMENTS} elements, more than a CPU run can hold "
                    f"(give the graph's symbolic dims smaller values with ++model.inputs.{plan.name}.shape=[...])"
                )


def _dtype(named: str | None, onnx_type: str, name: str):
    if named is not None:
        if named not in DTYPES:
            raise RecipeError(f"model.inputs.{name}.dtype={named} (use {', '.join(sorted(DTYPES))})")
        return DTYPES[named]
    inner = onnx_type.removeprefix("tensor(").removesuffix(")")
    if inner not in DTYPES:
        raise RecipeError(f"model input {name!r} is {onnx_type}, which data cannot be made for")
    return DTYPES[inner]


def random_tensor(plan: InputPlan, batch: int, rng: np.random.Generator) -> np.ndarray:
    shape = plan.shape(batch)
    if plan.value is not None:
        return np.full(shape, plan.value, dtype=plan.dtype)
    low, high = plan.spec.get("low"), plan.spec.get("high")
    kind = np.dtype(plan.dtype).kind
    if kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if kind in "iu":
        low, high = (0 if low is None else low), (100 if high is None else high)
        return rng.integers(int(low), int(high), size=shape).astype(plan.dtype)
    if low is not None and high is not None:
        return rng.uniform(low, high, size=shape).astype(plan.dtype)
    return rng.normal(plan.spec.get("mean", 0.0), plan.spec.get("std", 1.0), size=shape).astype(plan.dtype)
