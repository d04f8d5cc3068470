"""Engine: the modelopt-quantized module saved as a checkpoint (modelopt state + weights), so the
artifact reloads to exactly what was measured; also modelopt's Hugging Face export, the checkpoint
TensorRT-LLM / vLLM load, where this machine can pack the format."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.quantize.modelopt import cuda_missing
from optimize.registry import register

ENGINE_DIR = "modelopt"


@dataclass
class CheckpointConfig:
    """Example recipe:

    engine:
      method: modelopt_checkpoint
      params: {export_hf: true}
    """

    export_hf: bool = True  # also try modelopt's Hugging Face export (TensorRT-LLM / vLLM checkpoint)
    tensorrt: bool = False  # require TensorRT (GPU recipes): refused when it is not installed

    def validate(self):
        if self.tensorrt:
            missing = cuda_missing()
            if missing is None:
                try:
                    import tensorrt  # noqa: F401
                except ImportError:
                    missing = "the tensorrt package is not installed"
            if missing:
                raise RecipeError(f"engine.params.tensorrt=true needs CUDA and TensorRT: {missing}")


@register(
    "engine",
    "modelopt_checkpoint",
    CheckpointConfig,
    input_format="torch",
    tasks=("causal_lm",),
    engine_formats=(formats.MODELOPT_TORCH,),
)
def modelopt_checkpoint(model: Model, cfg: CheckpointConfig, ctx: Context) -> Model:
    """Save the modelopt-quantized module (state + weights) so the artifact reloads to what was measured."""
    if model.kind != "torch" or not _is_quantized(model.module):
        raise RecipeError("engine.method=modelopt_checkpoint needs a modelopt quantize method before it")
    import modelopt.torch.opt as mto

    out = ctx.scratch / "modelopt_engine"
    folder = out / ENGINE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    model.module.config.to_json_file(str(folder / "config.json"))
    mto.save(model.module, str(folder / "modelopt.pth"))
    export = _export_hf(model.module, folder / "hf_export") if cfg.export_hf else "not requested"
    engine = {"format": formats.MODELOPT_TORCH, "dir": ENGINE_DIR, "simulated": True}
    record = {"method": "modelopt_checkpoint", "hf_export": export}
    return model.with_engine(out, engine, precision=model.precision).recorded(record)


def _is_quantized(module) -> bool:
    return any(hasattr(m, "weight_quantizer") for m in module.modules())


def _export_hf(module, folder: Path) -> str:
    """modelopt's deployable checkpoint; on CPU some formats cannot pack, which is recorded, not fatal."""
    try:
        from modelopt.torch.export import export_hf_checkpoint

        export_hf_checkpoint(copy.deepcopy(module), export_dir=str(folder))
        return "written"
    except Exception as exc:  # modelopt raises many types for unsupported format/device pairs
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        return f"failed on this machine: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
