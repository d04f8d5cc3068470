"""ONNX Runtime dynamic INT8: weights quantized ahead of time, activations at run time."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.quantize.common import (
    auto_reduce_range,
    constants_to_initializers,
    op_types_refusal,
    quant_type,
    refuse_if_nothing_quantized,
    require_onnx,
    resolve_op_types,
    task_fidelity,
    workdir,
)
from optimize.quantize.sensitivity import sensitivity_fallback
from optimize.registry import register

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
    # null: the weighted op types the graph has (MatMul, Gemm, Conv with constant weights), recorded
    op_types: Optional[List[str]] = None
    nodes_to_exclude: List[str] = field(default_factory=list)
    # Sensitivity fallback: keep the nodes whose quantization hurts most in FP32 until the worst
    # calibration sample reaches this cosine against FP32 (null: quantize every node).
    fallback_min_cosine: Optional[float] = 0.995
    max_fp32_nodes: int = 8
    sensitivity_samples: int = 16
    # Quantize fused Attention too (QAttention): its QKV weights are packed into one initializer first.
    # Measured on MiniLM at batch 32 (AVX-512 VNNI): 3.5x PyTorch against 3.0x with Attention left FP32.
    quantize_attention: bool = False

    def uses_calibration(self) -> bool:
        """Only the sensitivity fallback reads calibration samples (plan-time checks ask)."""
        return self.fallback_min_cosine is not None

    def validate(self):
        if self.weight_type not in ("int8", "uint8"):
            raise RecipeError(f"quantize.params.weight_type={self.weight_type} (use int8 or uint8)")
        if self.max_fp32_nodes < 0 or self.sensitivity_samples < 1:
            raise RecipeError("quantize.params.max_fp32_nodes must be >= 0 and sensitivity_samples >= 1")


@register(
    "quantize",
    "ort_int8_dynamic",
    OrtInt8DynamicConfig,
    needs_calibration=True,
    input_format="onnx",
    refusal=op_types_refusal,
)
def ort_int8_dynamic(model: Model, cfg: OrtInt8DynamicConfig, ctx: Context) -> Model:
    """INT8 weights, activations quantized at run time (ONNX Runtime), with FP32 fallback of sensitive nodes."""
    require_onnx(model, "ort_int8_dynamic")
    from onnxruntime.quantization import quantize_dynamic

    reduce_range = auto_reduce_range(cfg.reduce_range)
    weight_type = quant_type(cfg.weight_type)
    out = workdir(ctx)
    source, packed = constants_to_initializers(model.onnx_file(), out), 0
    if cfg.quantize_attention:
        from engines.onnxruntime.fusion import pack_attention_qkv

        source, packed = pack_attention_qkv(source, out / "packed.onnx")
    op_types, chosen_by = resolve_op_types(cfg.op_types, source)
    cfg = dataclasses.replace(cfg, op_types=op_types + (["Attention"] if packed else []))

    def quantize(excluded: list[str]) -> Path:
        path = out / "model.onnx"
        quantize_dynamic(
            source,
            path,
            op_types_to_quantize=cfg.op_types,
            per_channel=cfg.per_channel,
            reduce_range=reduce_range,
            weight_type=weight_type,
            nodes_to_exclude=cfg.nodes_to_exclude + excluded,
        )
        return path

    fp32_nodes: list[str] = []
    score = None
    if cfg.fallback_min_cosine is not None:
        fp32_nodes, score = sensitivity_fallback(
            model.with_onnx(source), cfg, ctx, quantize, reduce_range, task_fidelity(model.task)
        )
    path = quantize(fp32_nodes)
    kernels = refuse_if_nothing_quantized(path, source, "ort_int8_dynamic", cfg.op_types)
    from optimize.evaluate.kernels import int8_gemm_speedup

    return model.with_onnx(path, precision="int8").recorded(
        {
            "method": "ort_int8_dynamic",
            "int8_gemm": int8_gemm_speedup(ctx.threads),
            "weights": cfg.weight_type,
            "activations": "uint8 dynamic",
            "per_channel": cfg.per_channel,
            "reduce_range": reduce_range,
            "fp32_nodes": fp32_nodes,
            "calibration_min_cosine": score,
            "packed_attention": packed,
            "op_types": cfg.op_types,
            "op_types_from": chosen_by,
            "kernels": kernels,
        }
    )
