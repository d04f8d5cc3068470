"""INT4 weight-only quantization (ONNX Runtime MatMulNBits): 4-bit weights in blocks along the input
dimension, each block with its own scale (and zero point when asymmetric); activations stay FP32.
Memory-bound decoding reads 4-8x fewer weight bytes; compute happens in FP32 (or int8 with
accuracy_level 4).

Algorithms (`algorithm`):
- rtn: plain round-to-nearest per block, symmetric or asymmetric (ORT's default quantizer).
- hqq: Half-Quadratic Quantization, asymmetric; optimizes scale and zero point per block to minimise
  the weight error under a sparsity-promoting loss. Needs no data (torch does the solve).
- gptq: calibrated; quantizes columns one at a time and updates the rest with the inverse Hessian
  of the layer's inputs (from the calibration data) so the layer's output error stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.quantize.common import CalibrationReader, onnx_input_names, require_onnx, workdir
from optimize.registry import register

ALGORITHMS = ("rtn", "hqq", "gptq")


@dataclass
class OrtInt4WeightOnlyConfig:
    """Example recipe:

    quantize:
      method: ort_int4_weight_only
      params: {algorithm: rtn, block_size: 32, symmetric: false}
    """

    algorithm: str = "rtn"  # rtn | hqq | gptq
    block_size: int = 32  # weights per scale along the input dimension (power of 2, >= 16)
    symmetric: bool = False  # rtn/gptq: no zero point (hqq is always asymmetric)
    accuracy_level: Optional[int] = None  # MatMulNBits compute type: null/0 default, 1 fp32, 4 int8 activations
    nodes_to_exclude: List[str] = field(default_factory=list)
    calibration_count: int = 16  # gptq: calibration items for the Hessians
    calibration_batch: int = 1
    percdamp: float = 0.01  # gptq: Hessian damping, as a fraction of its mean diagonal
    actorder: bool = False  # gptq: quantize columns in order of decreasing Hessian diagonal

    def validate(self):
        if self.algorithm not in ALGORITHMS:
            raise RecipeError(f"quantize.params.algorithm={self.algorithm} (use {', '.join(ALGORITHMS)})")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise RecipeError(f"quantize.params.block_size={self.block_size} (use a power of 2, at least 16)")
        if self.algorithm == "hqq" and self.symmetric:
            raise RecipeError("quantize.params.symmetric=true: hqq is asymmetric by construction (use rtn or gptq)")
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise RecipeError(f"quantize.params.accuracy_level={self.accuracy_level} (use 0-4 or null)")
        if min(self.calibration_count, self.calibration_batch) < 1:
            raise RecipeError("quantize.params.calibration_count and calibration_batch must be at least 1")


# GPTQ needs calibration data; the pipeline loads it for every ort_int4_weight_only recipe, so a recipe
# without calibration data fails before weights load, whichever algorithm it picks.
@register("quantize", "ort_int4_weight_only", OrtInt4WeightOnlyConfig, needs_calibration=True, input_format="onnx")
def ort_int4_weight_only(model: Model, cfg: OrtInt4WeightOnlyConfig, ctx: Context) -> Model:
    """INT4 weight-only MatMulNBits (ONNX Runtime): round-to-nearest, HQQ or GPTQ, per block."""
    require_onnx(model, "ort_int4_weight_only")
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(model.onnx_path)),
        block_size=cfg.block_size,
        is_symmetric=cfg.symmetric,
        accuracy_level=cfg.accuracy_level,
        nodes_to_exclude=cfg.nodes_to_exclude,
        algo_config=_algo_config(model, cfg, ctx),
    )
    quantizer.process()
    path = workdir(ctx, "quantize_int4") / "model.onnx"
    quantizer.model.save_model_to_file(str(path), use_external_data_format=False)
    packed = _count_nbits(path)
    if packed == 0:
        raise RecipeError("ort_int4_weight_only found no MatMul with a constant 2-D weight to quantize")
    return model.with_onnx(path, precision="int4").recorded(
        {
            "method": "ort_int4_weight_only",
            "algorithm": cfg.algorithm,
            "weights": "int4",
            "activations": "fp32",
            "block_size": cfg.block_size,
            "symmetric": cfg.symmetric if cfg.algorithm != "hqq" else False,
            "accuracy_level": cfg.accuracy_level,
            "matmulnbits_nodes": packed,
        }
    )


def _algo_config(model, cfg: OrtInt4WeightOnlyConfig, ctx):
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        GPTQWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
    )

    if cfg.algorithm == "hqq":
        return HQQWeightOnlyQuantConfig(block_size=cfg.block_size, bits=4, op_types_to_quantize=("MatMul",))
    if cfg.algorithm == "gptq":
        count = min(cfg.calibration_count, len(ctx.calibration().items))
        reader = CalibrationReader(
            ctx.calibration_inputs(count), onnx_input_names(model.onnx_path), cfg.calibration_batch
        )
        return GPTQWeightOnlyQuantConfig(
            calibration_data_reader=reader,
            percdamp=cfg.percdamp,
            block_size=cfg.block_size,
            actorder=cfg.actorder,
            op_types_to_quantize=("MatMul",),
        )
    return DefaultWeightOnlyQuantConfig(
        block_size=cfg.block_size,
        is_symmetric=cfg.symmetric,
        accuracy_level=cfg.accuracy_level,
        op_types_to_quantize=("MatMul",),
    )


def _count_nbits(path: Path) -> int:
    import onnx

    return sum(n.op_type == "MatMulNBits" for n in onnx.load(str(path), load_external_data=False).graph.node)
