"""Static INT8 QDQ (ONNX Runtime): weights and activations quantized ahead of time, with activation
ranges calibrated on the recipe's calibration data (never on random data unless the recipe names it).

Choices that matter on CPUs:
- activation_type uint8 + weight_type int8 (U8S8) is the pair ONNX Runtime's x86 kernels are fastest
  at, with or without VNNI; S8S8 was measured slower than FP32 on MiniLM here.
- reduce_range (7-bit weights) on CPUs without VNNI: AVX2's vpmaddubsw adds pairs of u8*s8 products
  into int16 and saturates with full-range weights. null picks it from the CPU.
- Transformers have activation outliers: percentile or entropy calibration clips them, graph fusion
  first (the onnx engine's ORT fusions, or optimize_graph: bert for an ONNX model brought as is)
  leaves LayerNorm/GELU/attention fused in FP32, and the sensitivity fallback keeps the nodes that
  hurt most in FP32, ranked by the error their calibrated (clipped) ranges cause.
- ONNX Runtime's MatMulConstBOnly option is ignored by the QDQ format, so MatMuls of two activations
  (attention's Q@K^T and probabilities@V, when not fused) are excluded here by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.quantize.common import (
    CalibrationReader,
    auto_reduce_range,
    constants_to_initializers,
    onnx_input_names,
    op_types_refusal,
    quant_type,
    refuse_if_nothing_quantized,
    require_onnx,
    task_fidelity,
    with_opset_at_least,
    workdir,
)
from optimize.quantize.sensitivity import sensitivity_fallback
from optimize.registry import register

log = logging.getLogger(__name__)
CALIBRATE_METHODS = ("minmax", "entropy", "percentile")


@dataclass
class OrtInt8StaticConfig:
    """Example recipe (a CNN; for an encoder add optimize_graph: bert and op_types: [MatMul]):

    quantize:
      method: ort_int8_static_qdq
      params: {calibrate_method: minmax, per_channel: true, activation_type: uint8, weight_type: int8}
    """

    calibrate_method: str = "minmax"  # minmax | entropy | percentile
    percentile: float = 99.999  # percentile calibration: the |activation| percentile kept unclipped
    activation_type: str = "uint8"  # uint8 | int8
    weight_type: str = "int8"  # int8 | uint8
    per_channel: bool = True
    reduce_range: Optional[bool] = None  # null: 7-bit weights on CPUs without VNNI
    symmetric_activations: bool = False
    op_types: Optional[List[str]] = None  # null: every op type ONNX Runtime can quantize
    nodes_to_exclude: List[str] = field(default_factory=list)
    # Keep in FP32 the nodes fed by these op types, e.g. [BiasGelu, Gelu, FastGelu]: GELU outputs are
    # heavy-tailed in transformers, and one static per-tensor scale loses either the tail or the bulk.
    exclude_consumers_of: List[str] = field(default_factory=list)
    matmul_const_b_only: bool = True  # quantize MatMuls with a constant weight only (not Q@K^T, attn@V)
    optimize_graph: str = "none"  # none | bert (onnxruntime.transformers.optimizer fusions first)
    calibration_count: int = 64  # calibration items used (at most calibration.count)
    calibration_batch: int = 8
    # Sensitivity fallback as in ort_int8_dynamic (null: off).
    fallback_min_cosine: Optional[float] = None
    max_fp32_nodes: int = 8
    sensitivity_samples: int = 16

    def validate(self):
        if self.calibrate_method not in CALIBRATE_METHODS:
            raise RecipeError(
                f"quantize.params.calibrate_method={self.calibrate_method} (use {', '.join(CALIBRATE_METHODS)})"
            )
        for key in ("activation_type", "weight_type"):
            if getattr(self, key) not in ("int8", "uint8"):
                raise RecipeError(f"quantize.params.{key}={getattr(self, key)} (use int8 or uint8)")
        if self.optimize_graph not in ("none", "bert"):
            raise RecipeError(f"quantize.params.optimize_graph={self.optimize_graph} (use none or bert)")
        if not 50 < self.percentile <= 100:
            raise RecipeError(f"quantize.params.percentile={self.percentile} (use a value in (50, 100])")
        if min(self.calibration_count, self.calibration_batch, self.sensitivity_samples) < 1:
            raise RecipeError(
                "quantize.params.calibration_count, calibration_batch and sensitivity_samples must be at least 1"
            )


@register(
    "quantize",
    "ort_int8_static_qdq",
    OrtInt8StaticConfig,
    needs_calibration=True,
    input_format="onnx",
    refusal=op_types_refusal,
)
def ort_int8_static_qdq(model: Model, cfg: OrtInt8StaticConfig, ctx: Context) -> Model:
    """INT8 weights and activations, activation ranges calibrated ahead of time (QDQ, ONNX Runtime)."""
    require_onnx(model, "ort_int8_static_qdq")
    out = workdir(ctx, "quantize_static")
    source = optimize_for_cpu(model.onnx_file(), out) if cfg.optimize_graph == "bert" else model.onnx_file()
    source = with_opset_at_least(constants_to_initializers(source, out), out)
    count = min(cfg.calibration_count, len(ctx.calibration().items))
    reader = CalibrationReader(ctx.calibration_inputs(count), onnx_input_names(source), cfg.calibration_batch)
    reduce_range = auto_reduce_range(cfg.reduce_range)
    excluded = cfg.nodes_to_exclude + consumers_of(source, cfg.exclude_consumers_of)
    if cfg.matmul_const_b_only:
        excluded += [n for n in matmuls_without_constant_b(source) if n not in excluded]
    # Activation ranges do not depend on which nodes are excluded: calibrate once, and let every
    # fallback round reuse the cached ranges instead of re-running the calibration set.
    cache = out / "calibration_ranges.json"
    cache.unlink(missing_ok=True)

    def quantize(fallback: list[str]) -> Path:
        path = out / "model.onnx"
        reader.rewind()
        _quantize_static(source, path, reader, cfg, reduce_range, excluded + fallback, cache)
        return path

    fp32_nodes: list[str] = []
    score = None
    if cfg.fallback_min_cosine is not None:
        fp32_nodes, score = sensitivity_fallback(
            model.with_onnx(source),
            _RankingView(cfg, excluded, cache),
            ctx,
            quantize,
            reduce_range,
            task_fidelity(model.task),
        )
    path = quantize(fp32_nodes)
    kernels = refuse_if_nothing_quantized(path, source, "ort_int8_static_qdq", cfg.op_types)
    from optimize.evaluate.kernels import int8_gemm_speedup

    return model.with_onnx(path, precision="int8").recorded(
        {
            "method": "ort_int8_static_qdq",
            "int8_gemm": int8_gemm_speedup(ctx.threads),
            "format": "QDQ",
            "weights": cfg.weight_type,
            "activations": f"{cfg.activation_type} static",
            "calibrate_method": cfg.calibrate_method,
            "percentile": cfg.percentile if cfg.calibrate_method == "percentile" else None,
            "per_channel": cfg.per_channel,
            "reduce_range": reduce_range,
            "optimize_graph": cfg.optimize_graph,
            "calibration_items": count,
            "excluded_nodes": excluded,
            "fp32_nodes": fp32_nodes,
            "calibration_min_cosine": score,
            "kernels": kernels,
        }
    )


def _quantize_static(
    source: Path, path: Path, reader, cfg: OrtInt8StaticConfig, reduce_range: bool, excluded: list[str], cache: Path
) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[cfg.calibrate_method]
    extra = {
        "WeightSymmetric": True,
        "ActivationSymmetric": cfg.symmetric_activations,
        "CalibPercentile": cfg.percentile,
    }
    quantize_static(
        str(source),
        str(path),
        reader,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=cfg.op_types,
        per_channel=cfg.per_channel,
        reduce_range=reduce_range,
        activation_type=quant_type(cfg.activation_type),
        weight_type=quant_type(cfg.weight_type),
        nodes_to_exclude=excluded,
        calibrate_method=method,
        extra_options=extra,
        calibration_cache_path=str(cache),
    )


def consumers_of(path: Path, op_types: list[str]) -> list[str]:
    """Names of the nodes that take an output of a node of one of `op_types` as input."""
    if not op_types:
        return []
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    produced = {o for n in graph.node if n.op_type in op_types for o in n.output}
    return [n.name for n in graph.node if produced & set(n.input)]


def matmuls_without_constant_b(path: Path) -> list[str]:
    """Names of the MatMuls whose B input is computed, not a weight (attention's Q@K^T and
    probabilities@V). ONNX Runtime's MatMulConstBOnly option only applies to the QOperator format, so
    QDQ quantization has to be told by name."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    return [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] not in weights]


def optimize_for_cpu(path: Path, out: Path) -> Path:
    """Fuse LayerNorm/SkipLayerNorm/GELU (onnxruntime.transformers.optimizer) so those stay FP32
    kernels and only the MatMuls between them get Q/DQ pairs."""
    from onnxruntime.transformers import optimizer

    fused = optimizer.optimize_model(str(path), model_type="bert", num_heads=0, hidden_size=0)
    target = out / "fused.onnx"
    fused.save_model_to_file(str(target))
    return target


class _RankingView:
    """What the shared sensitivity ranking reads from a config: op types, granularity, and the
    calibrated activation ranges (read once the first quantization has written them)."""

    def __init__(self, cfg: OrtInt8StaticConfig, excluded: list[str], ranges_file: Path):
        self.ranges_file = ranges_file
        self.op_types = [t for t in (cfg.op_types or ["MatMul", "Gemm", "Conv"]) if t in ("MatMul", "Gemm", "Conv")]
        self.per_channel = cfg.per_channel
        self.nodes_to_exclude = excluded  # already FP32: not ranked again
        self.fallback_min_cosine = cfg.fallback_min_cosine
        self.max_fp32_nodes = cfg.max_fp32_nodes
        self.sensitivity_samples = cfg.sensitivity_samples

    @property
    def activation_ranges(self) -> dict[str, tuple[float, float]]:
        return read_calibration_ranges(self.ranges_file) if self.ranges_file.exists() else {}


def read_calibration_ranges(path: Path) -> dict[str, tuple[float, float]]:
    """tensor -> (low, high) from ONNX Runtime's calibration cache (its TensorsData JSON, where a
    bound is a number or a serialized numpy array of one value)."""
    import json

    def number(value) -> float:
        data = value["data"] if isinstance(value, dict) else value
        return float(np.asarray(data, dtype=np.float64).reshape(-1)[0])

    data = json.loads(path.read_text())["data"]
    return {
        name: (number(r["lowest"]), number(r["highest"]))
        for name, r in data.items()
        if r.get("lowest") is not None and r.get("highest") is not None
    }
