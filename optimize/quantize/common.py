"""Helpers the ONNX Runtime quantize methods share: input checks, scratch folders, calibration batches,
and the CPU-dependent weight range."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np

from engines.hardware import cpu_has_vnni
from optimize.errors import RecipeError

# How close a quantized graph's outputs are to the float graph's: 1.0 is identical.
Fidelity = Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], float]


def task_fidelity(task_name: str) -> Fidelity:
    """The worst cosine of the output whose fidelity decides the task's accuracy (every output when
    the task names none): what the sensitivity fallback's target is checked against."""
    from optimize import tasks
    from optimize.evaluate.fidelity import worst_cosine

    output = tasks.get(task_name).fidelity_output
    return lambda reference, candidate: worst_cosine(reference, candidate, output)


def require_onnx(model, method: str) -> None:
    if model.kind != "onnx":
        raise RecipeError(f"quantize.method={method} needs an ONNX model (engine.method=onnx)")


def workdir(ctx, name: str = "quantize") -> Path:
    out = ctx.scratch / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def auto_reduce_range(setting: Optional[bool]) -> bool:
    """7-bit weights on CPUs without VNNI: AVX2's u8*s8 pair sums (vpmaddubsw) saturate int16 with
    full 8-bit weights; VNNI accumulates in int32 and needs no such margin."""
    return (not cpu_has_vnni()) if setting is None else setting


def quant_type(name: str):
    from onnxruntime.quantization import QuantType

    return {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}[name]


class CalibrationReader:
    """ONNX Runtime's CalibrationDataReader over named arrays, in batches (the graph's inputs only)."""

    def __init__(self, inputs: dict[str, np.ndarray], input_names: list[str], batch_size: int = 8):
        from optimize.evaluate.harness import batches_of

        self.batches = [{k: np.asarray(b[k]) for k in input_names} for b in batches_of(inputs, batch_size)]
        self.rewind()

    def get_next(self):
        return next(self._iter, None)

    def rewind(self):
        self._iter = iter(self.batches)

    def __iter__(self):  # GPTQ reads batches by iterating a copy of the reader
        return iter(self.batches)


def onnx_input_names(path: Path) -> list[str]:
    from engines.onnxruntime.runner import OrtRunner

    return OrtRunner(path).input_names


# Ops that run integer kernels in ONNX Runtime (dynamic, QOperator and fused-QDQ forms), and the
# float ops that carry weights: counting both says plainly how much of a graph is really INT8.
INT8_OPS = (
    "MatMulInteger",
    "DynamicQuantizeMatMul",
    "QLinearMatMul",
    "QAttention",
    "ConvInteger",
    "QLinearConv",
    "MatMulIntegerToFloat",
    "QGemm",
)
WEIGHTED_FLOAT_OPS = ("MatMul", "Gemm", "Conv", "Attention")


def int8_node_counts(onnx_path: Path) -> dict:
    """{'int8': n, 'float': m, 'by_op': {...}} over the nodes that carry weights. In QDQ graphs a
    MatMul/Conv whose weight comes from DequantizeLinear runs as INT8 once ONNX Runtime fuses it."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights}
    by_op: dict[str, int] = {}
    int8 = floating = 0
    for node in graph.node:
        if node.op_type in INT8_OPS or (
            node.op_type in ("MatMul", "Gemm", "Conv") and any(i in dequantized for i in node.input[1:2])
        ):
            int8 += 1
            by_op[node.op_type] = by_op.get(node.op_type, 0) + 1
        elif node.op_type in WEIGHTED_FLOAT_OPS and any(i in weights for i in node.input[1:]):
            floating += 1
            by_op[f"{node.op_type} (float)"] = by_op.get(f"{node.op_type} (float)", 0) + 1
    return {"int8": int8, "float": floating, "by_op": by_op}


def constants_to_initializers(path: Path, out: Path) -> Path:
    """The graph with its Constant-node tensors as initializers (exporters such as paddle2onnx write
    weights as Constant nodes, and ONNX Runtime's quantizers only quantize initializers). Returns
    `path` itself when there is nothing to move."""
    import onnx

    model = onnx.load(str(path))
    constants = [
        n
        for n in model.graph.node
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value"
    ]
    if not constants:
        return path
    for node in constants:
        tensor = onnx.TensorProto()
        tensor.CopyFrom(node.attribute[0].t)
        tensor.name = node.output[0]
        model.graph.initializer.append(tensor)
    moved = {id(n) for n in constants}
    kept = [n for n in model.graph.node if id(n) not in moved]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    target = out / "initializers.onnx"
    onnx.save(model, str(target))
    return target


# The op types ONNX Runtime's INT8 quantizers turn into INT8 kernels when their weight is a constant.
WEIGHTED_OPS = ("MatMul", "Gemm", "Conv")


def weighted_ops(path: Path) -> dict[str, int]:
    """{op type: count} of the graph's MatMul, Gemm and Conv nodes whose weight (input 1) is a constant:
    an initializer or a Constant node's output (as paddle2onnx writes weights)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    constants = {i.name for i in graph.initializer} | {
        n.output[0] for n in graph.node if n.op_type == "Constant" and n.output
    }
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] in constants:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def resolve_op_types(given: list[str] | None, path: Path) -> tuple[list[str], str]:
    """The op types a method quantizes: the recipe's, else the weighted ones the graph has (in
    WEIGHTED_OPS order); and which of the two it was, for the record."""
    if given is not None:
        return list(given), "recipe"
    found = set(weighted_ops(path))
    if "Gemm" in found:
        # ONNX Runtime's quantizers rewrite a Gemm into MatMul + Add and then quantize the MatMul only
        # if MatMul is asked for (measured: [Gemm] alone left a Linear model FP32).
        found.add("MatMul")
    return [op for op in WEIGHTED_OPS if op in found] or list(WEIGHTED_OPS), "graph"


def op_types_refusal(method: str, cfg, path: Path) -> str | None:
    """Known before quantizing (the `refusal` its methods register): the recipe's op_types match none
    of the graph's weighted nodes."""
    given = cfg.op_types
    if given is None:
        return None
    found = weighted_ops(path)
    if not found or set(given) & set(found):
        return None
    has = ", ".join(f"{n} {op}" for op, n in found.items())
    return (
        f"quantize.method={method} cannot apply to this model: quantize.params.op_types=[{', '.join(given)}] "
        f"matches none of the graph's weighted nodes ({has}): drop op_types to quantize the graph's own "
        f"({', '.join(found)}) or name them"
    )


def refuse_if_nothing_quantized(path: Path, source: Path, method: str, op_types: list[str] | None) -> dict:
    """The quantized graph's kernel counts; a graph where the method found nothing to quantize is
    refused with one line saying what the method looks for and what the graph has."""
    counts = int8_node_counts(path)
    if counts["int8"]:
        return counts
    weighted = int8_node_counts(source)["by_op"]
    has = ", ".join(f"{n} {op.replace(' (float)', '')}" for op, n in sorted(weighted.items())) or "none"
    looks_for = ", ".join(op_types) if op_types else "every op type ONNX Runtime quantizes"
    raise RecipeError(
        f"quantize.method={method} cannot apply to this model: it quantizes {looks_for} with constant weights, "
        f"and the graph's weighted nodes are: {has}"
        + (" (set quantize.params.op_types to include them)" if weighted else "")
    )


def with_opset_at_least(path: Path, out: Path, opset: int = 13) -> Path:
    """The graph converted to at least this ONNX opset: per-channel QDQ puts an axis on
    DequantizeLinear, which opset 13 introduced (exporters such as paddle2onnx write opset 11)."""
    import onnx
    from onnx import version_converter

    model = onnx.load(str(path))
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), opset)
    if current >= opset:
        return path
    target = out / f"opset{opset}.onnx"
    onnx.save(version_converter.convert_version(model, opset), str(target))
    return target
