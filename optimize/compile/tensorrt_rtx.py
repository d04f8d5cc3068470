"""Engine stage: an ahead-of-time TensorRT-RTX plan from the checked ONNX export.

The graph is exported (without ONNX Runtime's contrib fusions: TensorRT cannot run com.microsoft
ops), given its precision by the existing ONNX-side methods (TensorRT-RTX is strongly typed, so the
precision is the graph's: ort_fp16 casts it, ort_int8_static_qdq writes symmetric INT8 Q/DQ pairs),
and built into a plan in a child process (engines/tensorrt_rtx/build.py) with one optimization
profile per evaluated batch size. The plan ships beside the ONNX it was built from.

Building needs no GPU; running the plan needs an RTX-class one. Without it the artifact's accuracy
is measured on the ONNX the plan was built from (ONNX Runtime on CPU) and its latency is not
measured at all: the manifest says so, and a latency threshold fails as unmeasured.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
PRECISIONS = {"fp32": None, "fp16": "ort_fp16", "int8_qdq": "ort_int8_static_qdq"}
PLAN = "model.plan"
# Q/DQ as TensorRT reads it: INT8 both sides, symmetric (zero point 0), full 8-bit range.
QDQ_FOR_TENSORRT = {
    "activation_type": "int8",
    "weight_type": "int8",
    "symmetric_activations": True,
    "reduce_range": False,
}


@dataclass
class TensorrtRtxConfig:
    """Example recipe (MiniLM in FP16 for RTX GPUs):

        engine:
          method: tensorrt_rtx
          params: {precision: fp16, compute_capabilities: [SM86, SM89]}

    INT8: `precision: int8_qdq` with ort_int8_static_qdq's parameters under `quantize_params`
    (calibrated on the recipe's calibration data).
    """

    precision: str = "fp16"  # fp32 | fp16 (ort_fp16) | int8_qdq (ort_int8_static_qdq, symmetric INT8)
    # Parameters of the method that sets the precision. A recipe YAML sets them; the command line
    # overrides the keys a recipe sets (Hydra adds no new key to a typed mapping).
    quantize_params: Dict[str, Any] = field(default_factory=dict)
    # GPUs the plan is built for (tensorrt_rtx.ComputeCapability names); [] is the library's default.
    compute_capabilities: List[str] = field(default_factory=list)
    max_sequence: Optional[int] = None  # text models: the profiles' longest sequence (null: model.max_length)
    opset: int = 18
    build_timeout_s: int = 1800

    def validate(self):
        from engines.tensorrt_rtx.build import COMPUTE_CAPABILITIES

        if self.precision not in PRECISIONS:
            raise RecipeError(f"engine.params.precision={self.precision} (use {', '.join(PRECISIONS)})")
        unknown = [c for c in self.compute_capabilities if c not in COMPUTE_CAPABILITIES]
        if unknown:
            raise RecipeError(
                f"engine.params.compute_capabilities has {unknown} (use {', '.join(COMPUTE_CAPABILITIES)})"
            )
        if self.precision == "fp32" and self.quantize_params:
            raise RecipeError("engine.params.quantize_params is for precision fp16 or int8_qdq, not fp32")
        if self.precision == "int8_qdq":
            _refuse_asymmetric_qdq(self.quantize_params)
        if PRECISIONS[self.precision]:
            precision_config(self)  # the method's own checks, before any weights load
        if self.max_sequence is not None and self.max_sequence < 1:
            raise RecipeError("engine.params.max_sequence must be at least 1")


def _refuse_asymmetric_qdq(params: dict) -> None:
    for key, wanted in QDQ_FOR_TENSORRT.items():
        if key in params and params[key] != wanted:
            raise RecipeError(
                f"engine.params.quantize_params.{key}={params[key]}: TensorRT reads symmetric INT8 Q/DQ only "
                f"(leave it out or set {wanted})"
            )
    if params.get("optimize_graph", "none") != "none":
        raise RecipeError(
            "engine.params.quantize_params.optimize_graph fuses into com.microsoft ops, which TensorRT cannot "
            "build: leave it out"
        )


@register(
    "engine",
    "tensorrt_rtx",
    TensorrtRtxConfig,
    input_format="torch",
    needs_calibration=True,
    builds_candidates=True,
    engine_formats=(formats.TENSORRT_RTX, formats.ONNXRUNTIME),  # ONNX Runtime where no plan fits
)
def tensorrt_rtx_engine(model: Model, cfg: TensorrtRtxConfig, ctx: Context) -> Model:
    """TensorRT-RTX plan (FP32, FP16 or Q/DQ INT8) built ahead of time from the checked ONNX export."""
    from engines.tensorrt_rtx.build import BuildRefused, build_plan, missing_module
    from optimize.compile.onnx import OnnxExportConfig, onnx_engine

    # Checked here rather than at plan time so that every preset still plans where the optional extra
    # is not installed; this is the first thing the engine does, before the export writes anything.
    missing = missing_module()
    if missing:
        raise RecipeError(f"engine.method=tensorrt_rtx needs {missing}")
    exported = onnx_engine(model, OnnxExportConfig(opset=cfg.opset, ort_fusions=False), ctx)
    onnx_model = _with_precision(exported, cfg, ctx)
    out = ctx.scratch / "tensorrt_rtx"
    shutil.rmtree(out, ignore_errors=True)
    from engines.onnxruntime.export import copy_onnx

    onnx_path = copy_onnx(onnx_model.onnx_path, out)
    folded = fold_int32_dequantize(onnx_path) if cfg.precision == "int8_qdq" else 0
    profiles = optimization_profiles(onnx_path, ctx, cfg.max_sequence)
    log.info("tensorrt_rtx: building %s (%s, %d profiles)", PLAN, cfg.precision, len(profiles))
    try:
        report = build_plan(onnx_path, out / PLAN, profiles, cfg.compute_capabilities, cfg.build_timeout_s)
    except BuildRefused as exc:
        raise RecipeError(str(exc)) from None
    engine, measured = _engine_block(onnx_path, report, cfg)
    record = {
        "method": "tensorrt_rtx",
        "precision": cfg.precision,
        "export_check": exported.record.get("export_check"),
        "int32_dequantize_folded": folded,
        "build": report,
        "measured": measured,
    }
    # The stages run within this one, in the order they ran: the export (this record takes its
    # place), then the quantize method that set the precision.
    inner = {"engine": exported.record, **({"quantize": onnx_model.record} if onnx_model is not exported else {})}
    hook = _unmeasured_latency(measured["latency"]) if engine["format"] != "tensorrt-rtx" else None
    built = onnx_model.with_engine(out, engine, onnx_model.precision)
    return built.recorded(record, metric_hook=hook, inner_records=inner)


def precision_config(cfg: TensorrtRtxConfig):
    """(the registered quantize method that writes the plan's precision, its checked config)."""
    from optimize import registry

    method = registry.get("quantize", PRECISIONS[cfg.precision] or "")
    params = dict(cfg.quantize_params)
    if method.name == "ort_fp16":
        params.setdefault("execution_provider", "CPUExecutionProvider")  # the FP16 graph is checked on CPU
    else:
        params = {**params, **QDQ_FOR_TENSORRT}
    try:
        return method, registry.build_config(method, params)
    except RecipeError as exc:  # name the key where this recipe sets it
        raise RecipeError(str(exc).replace("quantize.params.", "engine.params.quantize_params.")) from None


def _with_precision(model, cfg: TensorrtRtxConfig, ctx):
    """The graph in the plan's precision, set by the registered ONNX-side method that writes it."""
    if PRECISIONS[cfg.precision] is None:
        return model
    method, config = precision_config(cfg)
    return method.fn(model, config, ctx)


def fold_int32_dequantize(path: Path) -> int:
    """Replace each DequantizeLinear of an INT32 constant (ONNX Runtime's quantized Conv and Gemm
    biases) by its FP32 value, in place; returns how many. TensorRT's Q/DQ takes 8-bit and smaller
    types only, and fuses an FP32 bias into the INT8 kernel itself."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    constants = {t.name: t for t in model.graph.initializer}
    folded = []
    for node in model.graph.node:
        source = constants.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if source is None or source.data_type != onnx.TensorProto.INT32:
            continue
        value = numpy_helper.to_array(source).astype(np.float64)
        scale = numpy_helper.to_array(constants[node.input[1]]).astype(np.float64)
        zero = numpy_helper.to_array(constants[node.input[2]]) if len(node.input) > 2 and node.input[2] else 0
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        if np.ndim(scale) == 1 and value.ndim > 0:  # per channel along `axis`
            shape = [1] * value.ndim
            shape[axis if value.ndim > 1 else 0] = -1
            scale, zero = scale.reshape(shape), np.reshape(zero, shape) if np.ndim(zero) == 1 else zero
        real = ((value - zero) * scale).astype(np.float32)
        model.graph.initializer.append(numpy_helper.from_array(real, node.output[0]))
        folded.append(node)
    for node in folded:
        model.graph.node.remove(node)
    if folded:
        used = {name for n in model.graph.node for name in n.input}
        for tensor in [t for t in model.graph.initializer if t.name not in used]:
            model.graph.initializer.remove(tensor)
        onnx.save(model, str(path))
    return len(folded)


def optimization_profiles(onnx_path: Path, ctx, max_sequence: int | None) -> list[dict[str, list[list[int]]]]:
    """One profile per evaluated batch size b (covering the batches above the previous size up to b,
    optimized for b); a text model's sequence axis runs from 1 to max_sequence (model.max_length),
    optimized for the calibration texts' padded length; every other dim is the graph's or, where the
    graph leaves it symbolic, the sample's (model.inputs)."""
    import onnx

    graph_inputs = _graph_inputs(onnx.load(str(onnx_path), load_external_data=False))
    sample = ctx.calibration_inputs(8)
    axes = getattr(sample, "batch_axes", {})
    text = hasattr(ctx.encoder, "max_length") and not hasattr(ctx.encoder, "random")
    longest = max_sequence or int(ctx.plan.model.max_length)
    profiles, low = [], 1
    for batch in sorted(set(int(b) for b in ctx.plan.evaluate.batch_sizes)):
        profile = {}
        for name, dims in graph_inputs.items():
            if name not in sample:
                raise RecipeError(f"the graph's input {name} is not among the model's inputs ({sorted(sample)})")
            spans = [
                _span(dim, axis, axes.get(name, 0), sample[name].shape, (low, batch), longest if text else None)
                for axis, dim in enumerate(dims)
            ]
            profile[name] = [[s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans]]
        if profile not in profiles:  # a graph with a fixed batch has one profile
            profiles.append(profile)
        low = batch + 1
    return profiles


def _span(dim, axis: int, batch_axis, shape: tuple, batches: tuple[int, int], longest: int | None) -> tuple:
    """(min, opt, max) of one dim: fixed in the graph, the batch range, a text sequence, or the sample's."""
    if isinstance(dim, int):
        return (dim, dim, dim)
    if axis == batch_axis:
        return (batches[0], batches[1], batches[1])
    if longest is not None and axis == 1:
        return (1, min(shape[axis], longest), longest)
    return (shape[axis],) * 3


def _graph_inputs(model) -> dict[str, list]:
    """Each graph input's dims: an int where fixed, the symbol's name (or None) where not."""
    initializers = {t.name for t in model.graph.initializer}
    return {
        i.name: [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in i.type.tensor_type.shape.dim
        ]
        for i in model.graph.input
        if i.name not in initializers
    }


def _engine_block(onnx_path: Path, report: dict, cfg: TensorrtRtxConfig) -> tuple[dict, dict]:
    """(the engine block, what was measured on what). On an RTX GPU the pipeline measures the plan
    itself; elsewhere the ONNX it was built from, on ONNX Runtime's CPU provider, for accuracy only."""
    from engines.tensorrt_rtx.runner import missing

    plan = {
        "file": PLAN,
        "built_from": onnx_path.name,
        "precision": cfg.precision,
        "tensorrt_rtx": report.get("tensorrt_rtx"),
        "profiles": report.get("profiles"),
        "compute_capabilities": report.get("compute_capabilities"),
    }
    lacking = missing()
    if not lacking:
        engine = {"format": formats.TENSORRT_RTX, "file": PLAN, "onnx": onnx_path.name, "plan": plan}
        return engine, {"accuracy": f"{PLAN} on this RTX GPU", "latency": f"{PLAN} on this RTX GPU"}
    measured = {
        "accuracy": f"{onnx_path.name} (the graph {PLAN} was built from) with ONNX Runtime on CPU, not the plan",
        "latency": f"not measured: {PLAN} needs " + "; ".join(lacking),
    }
    engine = {
        "format": formats.ONNXRUNTIME,
        "file": onnx_path.name,
        "providers": ["CPUExecutionProvider"],
        "plan": {**plan, **measured},
    }
    return engine, measured


def _unmeasured_latency(note: str):
    """A metric hook: the CPU timings of the ONNX graph are not the plan's, so none is reported."""

    def hook(metrics: dict) -> None:
        candidate = metrics["candidate"]
        for key in ("latency", "speedup", "timing"):
            candidate.pop(key, None)
        candidate["speed_note"] = note

    return hook
