"""FP16 for GPU execution providers (CUDA, TensorRT): FP16 weights and activations, FP32 inputs and
outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from engines.onnxruntime.providers import PROVIDERS, missing_for
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.quantize.common import require_onnx, workdir
from optimize.registry import register


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
            raise RecipeError(
                f"quantize.params.execution_provider={self.execution_provider} (use one of {', '.join(PROVIDERS)})"
            )
        missing = missing_for(self.execution_provider)
        if missing:  # checked before any weights load: one line that says what is missing
            raise RecipeError(
                f"quantize.method=ort_fp16 targets {self.execution_provider}, and this machine lacks "
                + "; ".join(missing)
            )


@register("quantize", "ort_fp16", OrtFp16Config, input_format="onnx")
def ort_fp16(model: Model, cfg: OrtFp16Config, ctx: Context) -> Model:
    """FP16 weights and activations for GPU execution providers (CUDA, TensorRT), FP32 inputs/outputs."""
    require_onnx(model, "ort_fp16")
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    fp32 = onnx.load(str(model.onnx_path))
    fp16 = convert_float_to_float16(
        fp32,
        keep_io_types=cfg.keep_io_types,
        op_block_list=list(DEFAULT_OP_BLOCK_LIST) + cfg.op_block_list,
        node_block_list=cfg.nodes_to_exclude,
    )
    path = workdir(ctx) / "model.onnx"
    onnx.save(fp16, str(path))
    providers = [cfg.execution_provider] + [
        p
        for p in PROVIDERS
        if p != cfg.execution_provider and PROVIDERS.index(p) > PROVIDERS.index(cfg.execution_provider)
    ]
    result = model.with_onnx(path, precision="fp16")
    result.engine["providers"] = providers
    return result.recorded(
        {
            "method": "ort_fp16",
            "weights": "fp16",
            "activations": "fp16",
            "keep_io_types": cfg.keep_io_types,
            "providers": providers,
        }
    )
