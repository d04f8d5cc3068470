"""Engine stage: the pipeline's own PyTorch model (pruned, distilled, as the torch-side stages left
it) on one NVIDIA GPU, in bf16, with FP8 Linears (e4m3 weights and dynamically scaled activations
through torch._scaled_mm; Ada/Hopper) or INT4 weight-only Linears (aten._weight_int4pack_mm, groups
of 32/64/128), compiled with torch.compile mode="reduce-overhead" so decoding replays CUDA graphs.
Only kernels torch ships are used (engines/pytorch/cuda_quant.py); runners in engines/pytorch/cuda_runner.py.

The artifact holds the bf16 weights plus the precision; the runner rebuilds the FP8/INT4 weights
from them on load (deterministic round-to-nearest). Without a CUDA device the recipe is refused at
plan time, before any weights load.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

ENGINE_DIR = "torch_cuda"
COMPILE_MODES = ("reduce-overhead", "max-autotune", "default", "none")
TASKS = ("causal_lm", "sentence_embedding")


@dataclass
class TorchCudaConfig:
    """Example recipe (SmolLM2 with INT4 weights in groups of 64):

        engine:
          method: torch_cuda
          params: {precision: int4, group_size: 64}

    group_size must divide the in_features of a Linear for it to be swapped (SmolLM2's 576: 32 or
    64); a Linear that does not fit is kept in bf16 and listed in the manifest.
    """

    precision: str = "bf16"  # bf16 | fp8 (per-tensor e4m3, needs compute capability 8.9+) | int4 (weight-only)
    group_size: int = 128  # int4: input channels per scale and zero point (32, 64 or 128)
    compile: str = "reduce-overhead"  # torch.compile mode (reduce-overhead: CUDA graphs); none: eager

    def validate(self):
        from engines.pytorch.cuda_quant import INT4_GROUP_SIZES, PRECISIONS
        from engines.pytorch.cuda_runner import cuda_missing

        if self.precision not in PRECISIONS:
            raise RecipeError(f"engine.params.precision={self.precision} (use {', '.join(PRECISIONS)})")
        if self.group_size not in INT4_GROUP_SIZES:
            raise RecipeError(f"engine.params.group_size={self.group_size} (use 32, 64 or 128)")
        if self.compile not in COMPILE_MODES:
            raise RecipeError(f"engine.params.compile={self.compile} (use {', '.join(COMPILE_MODES)})")
        missing = cuda_missing(self.precision)
        if missing:  # checked at plan time, before any weights load
            raise RecipeError(f"engine.method=torch_cuda needs {missing}")


@register(
    "engine", "torch_cuda", TorchCudaConfig, input_format="torch", tasks=TASKS, engine_formats=(formats.TORCH_CUDA,)
)
def torch_cuda_engine(model: Model, cfg: TorchCudaConfig, ctx: Context) -> Model:
    """PyTorch on an NVIDIA GPU: bf16, FP8 (torch._scaled_mm) or INT4 weight-only, CUDA graphs."""
    if model.kind != "torch" or not hasattr(model.module, "save_pretrained"):
        raise RecipeError("engine.method=torch_cuda needs a Hugging Face model from the torch-side stages")
    import copy

    from engines.pytorch.cuda_runner import prepare

    out = ctx.scratch / "torch_cuda_engine"
    shutil.rmtree(out, ignore_errors=True)
    model.module.save_pretrained(str(out / ENGINE_DIR))
    # The swap on a copy, here, so the manifest lists what the runner will swap (same rules, same shapes).
    _, swapped = prepare(copy.deepcopy(model.module), cfg.precision, cfg.group_size)
    engine = {
        "format": formats.TORCH_CUDA,
        "model_dir": ENGINE_DIR,
        "task": model.task,
        "precision": cfg.precision,
        "group_size": cfg.group_size,
        "compile": None if cfg.compile == "none" else cfg.compile,
    }
    if model.task == "sentence_embedding":
        engine["pooling"] = ctx.pooling
    record = {"method": "torch_cuda", "compile": cfg.compile, **swapped}
    return model.with_engine(out, engine, precision=cfg.precision).recorded(record)
