"""Quantize stage: ONNX Runtime INT8 dynamic, FP16, and the helpers the other quantize modules share.

Methods are named after their numerics. Static INT8 QDQ lives in quantize_static.py, INT4
weight-only (MatMulNBits) in quantize_int4.py; all are registered with @register and listed in
registry.PLUGIN_MODULES.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from optimize.environment import cpu_has_vnni
from optimize.errors import RecipeError
from optimize.registry import register
from optimize import tasks

log = logging.getLogger(__name__)


@dataclass
class OrtInt8DynamicConfig:
    """Example recipe:

        quantize:
          method: ort_int8_dynamic
          params: {per_channel: true, fallback_min_cosine: 0.995, max_fp32_nodes: 8}
    """

    per_channel: bool = True
    # 7-bit weights avoid the u8*s8 pair-sum overflow of CPUs without VNNI (AVX2 vpmaddubsw
    # saturates); null picks it from the CPU.
    reduce_range: Optional[bool] = None
    weight_type: str = "int8"  # int8 | uint8
    op_types: List[str] = field(default_factory=lambda: ["MatMul", "Gemm"])
    nodes_to_exclude: List[str] = field(default_factory=list)
    # Sensitivity fallback: keep the nodes whose quantization hurts most in FP32 until the worst
    # calibration sample reaches this cosine against FP32 (null: quantize every node).
    fallback_min_cosine: Optional[float] = 0.995
    max_fp32_nodes: int = 8
    sensitivity_samples: int = 16

    def validate(self):
        if self.weight_type not in ("int8", "uint8"):
            raise RecipeError(f"quantize.params.weight_type={self.weight_type} (use int8 or uint8)")
        if self.max_fp32_nodes < 0 or self.sensitivity_samples < 1:
            raise RecipeError("quantize.params.max_fp32_nodes must be >= 0 and sensitivity_samples >= 1")


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
        from optimize.evaluate import batches_of

        self.batches = [{k: b[k] for k in input_names} for b in batches_of(inputs, batch_size)]
        self.rewind()

    def get_next(self):
        return next(self._iter, None)

    def rewind(self):
        self._iter = iter(self.batches)

    def __iter__(self):  # GPTQ reads batches by iterating a copy of the reader
        return iter(self.batches)


def onnx_input_names(path: Path) -> list[str]:
    from engines.onnxruntime_runner import OrtRunner

    return OrtRunner(path).input_names


@register("quantize", "ort_int8_dynamic", OrtInt8DynamicConfig, needs_calibration=True, input_format="onnx")
def ort_int8_dynamic(model, cfg: OrtInt8DynamicConfig, ctx):
    """INT8 weights, activations quantized at run time (ONNX Runtime), with FP32 fallback of sensitive nodes."""
    require_onnx(model, "ort_int8_dynamic")
    from onnxruntime.quantization import quantize_dynamic

    reduce_range = auto_reduce_range(cfg.reduce_range)
    weight_type = quant_type(cfg.weight_type)
    out = workdir(ctx)

    def quantize(excluded: list[str]) -> Path:
        path = out / "model.onnx"
        quantize_dynamic(model.onnx_path, path, op_types_to_quantize=cfg.op_types, per_channel=cfg.per_channel,
                         reduce_range=reduce_range, weight_type=weight_type,
                         nodes_to_exclude=cfg.nodes_to_exclude + excluded)
        return path

    fp32_nodes, score = [], None
    if cfg.fallback_min_cosine is not None:
        fp32_nodes, score = sensitivity_fallback(model, cfg, ctx, quantize, reduce_range)
    path = quantize(fp32_nodes)
    ctx.record("quantize", {"method": "ort_int8_dynamic", "weights": cfg.weight_type, "activations": "uint8 dynamic",
                            "per_channel": cfg.per_channel, "reduce_range": reduce_range,
                            "fp32_nodes": fp32_nodes, "calibration_min_cosine": score})
    return model.with_onnx(path, precision="int8")


def _weighted_matmuls(graph, op_types: list[str], excluded: list[str]) -> list[tuple[str, str, str, bool]]:
    """(node name, activation input, weight initializer, weight transposed) of each quantizable node."""
    weights = {i.name for i in graph.initializer}
    found = []
    for node in graph.node:
        if node.op_type not in op_types or node.name in excluded or len(node.input) < 2:
            continue
        if node.input[1] in weights:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            found.append((node.name, node.input[0], node.input[1], trans_b))
    return found


def _simulated_error(x: np.ndarray, w: np.ndarray, per_channel: bool, reduce_range: bool,
                     x_range: Optional[tuple[float, float]] = None) -> float:
    """Relative error of x @ w when x is quantized to uint8, per tensor, asymmetric, and w to symmetric
    int8 (per output column when per_channel). x's range is its own min/max, as ONNX Runtime's
    DynamicQuantizeLinear computes it, unless `x_range` gives the calibrated range of a static model."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    lo, hi = x_range if x_range is not None else (x.min(), x.max())
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    x_scale = (hi - lo) / 255 or 1.0
    x_zero = np.round(-lo / x_scale)
    xq = (np.clip(np.round(x / x_scale) + x_zero, 0, 255) - x_zero) * x_scale
    qmax = 63 if reduce_range else 127
    w_max = np.abs(w).max(axis=0, keepdims=True) if per_channel else np.abs(w).max()
    w_scale = np.where(w_max > 0, w_max / qmax, 1.0)
    wq = np.clip(np.round(w / w_scale), -qmax, qmax) * w_scale
    exact = x @ w
    return float(np.linalg.norm(xq @ wq - exact) / max(np.linalg.norm(exact), 1e-30))


def _rank_by_simulated_error(onnx_path: Path, inputs: dict, cfg, reduce_range: bool) -> list[str]:
    """One FP32 run records every quantizable node's input; nodes are ranked by the relative error
    that quantizing them alone adds to their own output (largest first). A static method's config
    gives `activation_ranges` (tensor -> calibrated (low, high)): those ranges, clipping included,
    are what its activations are quantized with."""
    import onnx
    from onnx import numpy_helper

    from engines.onnxruntime_runner import OrtRunner

    model = onnx.load(str(onnx_path))
    nodes = _weighted_matmuls(model.graph, cfg.op_types, cfg.nodes_to_exclude)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    for activation in dict.fromkeys(a for _, a, _, _ in nodes):
        if activation not in outputs:
            model.graph.output.append(onnx.helper.make_tensor_value_info(activation, onnx.TensorProto.FLOAT, None))
    probe = onnx_path.with_name("activations.onnx")
    onnx.save(model, str(probe))
    activations = OrtRunner(probe)(inputs)
    probe.unlink()
    ranges = getattr(cfg, "activation_ranges", None) or {}
    errors = {}
    for name, activation, weight, trans_b in nodes:
        w = weights[weight].T if trans_b else weights[weight]
        errors[name] = _simulated_error(activations[activation], w, cfg.per_channel, reduce_range,
                                        ranges.get(activation))
    return sorted(errors, key=errors.get, reverse=True)


def sensitivity_fallback(model, cfg, ctx, quantize, reduce_range: bool) -> tuple[list[str], float]:
    """Keep the nodes with the largest simulated quantization error in FP32, one by one, until the
    real quantized model reaches the calibration fidelity target (or max_fp32_nodes is reached)."""
    from engines.onnxruntime_runner import OrtRunner

    output = tasks.get(model.task).fidelity_output
    inputs = ctx.calibration_inputs(cfg.sensitivity_samples)
    reference = OrtRunner(model.onnx_path, threads=ctx.threads)(inputs)

    def score(path: Path) -> float:
        return tasks.fidelity(reference, OrtRunner(path, threads=ctx.threads)(inputs), output)

    best = score(quantize([]))
    if best >= cfg.fallback_min_cosine or cfg.max_fp32_nodes == 0:
        return [], best
    ranked = _rank_by_simulated_error(model.onnx_path, inputs, cfg, reduce_range)
    fp32 = []
    for node in ranked[: cfg.max_fp32_nodes]:
        fp32.append(node)
        best = score(quantize(fp32))
        log.info("fallback: %d FP32 nodes, calibration min cosine %.5f", len(fp32), best)
        if best >= cfg.fallback_min_cosine:
            break
    return fp32, best


# ---------------------------------------------------------------------------------------------
# FP16 for GPU targets
# ---------------------------------------------------------------------------------------------
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
PROVIDERS = (*GPU_PROVIDERS, "CPUExecutionProvider")


def missing_for(provider: str) -> list[str]:
    """What this machine lacks to run `provider` (empty: nothing), each as a short phrase."""
    import importlib.util

    import onnxruntime as ort

    from optimize.environment import gpus

    if provider == "CPUExecutionProvider":
        return []
    missing = [] if gpus() else ["an NVIDIA GPU with CUDA (nvidia-smi finds none)"]
    if provider not in ort.get_available_providers():
        missing.append(f"onnxruntime with {provider} (install onnxruntime-gpu; this onnxruntime has "
                       f"{', '.join(ort.get_available_providers())})")
    if provider == "TensorrtExecutionProvider" and importlib.util.find_spec("tensorrt") is None:
        missing.append("TensorRT (the tensorrt Python package)")
    return missing


@dataclass
class OrtFp16Config:
    """Example recipe (GPU serving through ONNX Runtime's TensorRT provider):

        quantize:
          method: ort_fp16
          params: {execution_provider: TensorrtExecutionProvider, keep_io_types: true}

    On CPUExecutionProvider the FP16 graph runs, slowly (ORT's CPU kernels upcast most ops): useful to
    check accuracy on a machine without a GPU, not to serve.
    """

    execution_provider: str = "CUDAExecutionProvider"  # TensorrtExecutionProvider | CUDAExecutionProvider | CPU...
    keep_io_types: bool = True  # FP32 inputs and outputs: callers need not know the graph is FP16
    op_block_list: List[str] = field(default_factory=list)  # op types kept in FP32 (besides ORT's defaults)
    nodes_to_exclude: List[str] = field(default_factory=list)

    def validate(self):
        if self.execution_provider not in PROVIDERS:
            raise RecipeError(f"quantize.params.execution_provider={self.execution_provider} "
                              f"(use one of {', '.join(PROVIDERS)})")
        missing = missing_for(self.execution_provider)
        if missing:  # checked before any weights load: one line that says what is missing
            raise RecipeError(f"quantize.method=ort_fp16 targets {self.execution_provider}, and this machine lacks "
                              + "; ".join(missing))


@register("quantize", "ort_fp16", OrtFp16Config, input_format="onnx")
def ort_fp16(model, cfg: OrtFp16Config, ctx):
    """FP16 weights and activations for GPU execution providers (CUDA, TensorRT), FP32 inputs/outputs."""
    require_onnx(model, "ort_fp16")
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    fp32 = onnx.load(str(model.onnx_path))
    fp16 = convert_float_to_float16(fp32, keep_io_types=cfg.keep_io_types,
                                    op_block_list=list(DEFAULT_OP_BLOCK_LIST) + cfg.op_block_list,
                                    node_block_list=cfg.nodes_to_exclude)
    path = workdir(ctx) / "model.onnx"
    onnx.save(fp16, str(path))
    providers = [cfg.execution_provider] + [p for p in PROVIDERS if p != cfg.execution_provider
                                            and PROVIDERS.index(p) > PROVIDERS.index(cfg.execution_provider)]
    ctx.record("quantize", {"method": "ort_fp16", "weights": "fp16", "activations": "fp16",
                            "keep_io_types": cfg.keep_io_types, "providers": providers})
    result = model.with_onnx(path, precision="fp16")
    result.engine["providers"] = providers
    return result
