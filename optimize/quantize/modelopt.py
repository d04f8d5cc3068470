"""NVIDIA Model Optimizer (nvidia-modelopt) on the PyTorch side: FP8, INT8 SmoothQuant, INT4 AWQ, W4A8 AWQ,
NVFP4.

On CPU these run as simulated (fake) quantization: weights and activations are rounded to the target
format and computed in FP32, which measures accuracy, not speed. The `modelopt_checkpoint` engine
saves the quantized model (modelopt state + weights) so the artifact reloads to exactly what was
measured, and tries modelopt's Hugging Face export, the checkpoint TensorRT-LLM / vLLM load.
NVFP4 and device=cuda need CUDA; without it the recipe is refused (exit 2) before weights load.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
ENGINE_DIR = "modelopt"
# method name -> (modelopt config name, needs CUDA)
FORMATS = {
    "modelopt_fp8": ("FP8_DEFAULT_CFG", False),
    "modelopt_int8_smoothquant": ("INT8_SMOOTHQUANT_CFG", False),
    "modelopt_int4_awq": ("INT4_AWQ_CFG", False),
    "modelopt_w4a8_awq": ("W4A8_AWQ_BETA_CFG", False),
    "modelopt_nvfp4": ("NVFP4_DEFAULT_CFG", True),
}


def cuda_missing() -> str | None:
    """What is missing for a CUDA run, in words; None when CUDA is usable."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else "no visible CUDA device"
        return f"CUDA is not available ({build})"
    return None


@dataclass
class ModeloptConfig:
    """Example recipe:

    quantize:
      method: modelopt_fp8
      params: {calibration_samples: 32, max_tokens: 256, device: cpu}
    """

    calibration_samples: int = 32  # calibration texts run through the model to collect ranges
    max_tokens: int = 256  # tokens per calibration text
    device: str = "cpu"  # cpu (simulated quantization) | cuda

    def validate(self):
        if self.device not in ("cpu", "cuda"):
            raise RecipeError(f"quantize.params.device={self.device} (use cpu or cuda)")
        if self.calibration_samples < 1 or self.max_tokens < 2:
            raise RecipeError("quantize.params.calibration_samples must be >= 1 and max_tokens >= 2")
        if self.device == "cuda" and cuda_missing():
            raise RecipeError(f"quantize.params.device=cuda needs CUDA: {cuda_missing()}")


@dataclass
class NvFp4Config(ModeloptConfig):
    device: str = "cuda"

    def validate(self):
        missing = cuda_missing()
        if missing:  # modelopt's NVFP4 kernels and calibration need a GPU
            raise RecipeError(f"quantize.method=modelopt_nvfp4 needs CUDA: {missing}")
        super().validate()


def _register(name: str, cfg_name: str, needs_cuda: bool):
    config_cls = NvFp4Config if needs_cuda else ModeloptConfig

    def method(model: Model, cfg: ModeloptConfig, ctx: Context) -> Model:
        return quantize(model, cfg, ctx, name, cfg_name)

    method.__doc__ = f"nvidia-modelopt {cfg_name} (simulated quantization on CPU)"  # before register reads it
    return register("quantize", name, config_cls, needs_calibration=True, input_format="torch", tasks=("causal_lm",))(
        method
    )


def _import_modelopt():
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise RecipeError(
            f'modelopt methods need nvidia-modelopt ({exc}): pip install nvidia-modelopt "torch==2.13.0"'
        ) from None
    return mtq


def quantize(model: Model, cfg: ModeloptConfig, ctx: Context, name: str, cfg_name: str) -> Model:
    """Calibrate and insert quantizers into a copy of the module (the baseline keeps the original)."""
    if model.kind != "torch":
        raise RecipeError(f"quantize.method={name} needs the PyTorch model (it runs before the engine)")
    mtq = _import_modelopt()
    import torch

    module = copy.deepcopy(model.module).to(cfg.device)
    batches = _calibration_batches(ctx, cfg)

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids.to(cfg.device), use_cache=False)

    log.info("%s: calibrating on %d texts", name, len(batches))
    module = mtq.quantize(module, copy.deepcopy(getattr(mtq, cfg_name)), forward_loop)
    layers = quantized_linears(module)
    record = {
        "method": name,
        "modelopt_config": cfg_name,
        "device": cfg.device,
        "simulated": cfg.device == "cpu",
        "calibration_samples": len(batches),
        "layer_precision": layers,
    }
    precision = name.removeprefix("modelopt_")
    module = module.to("cpu").eval()
    return dataclasses.replace(model, module=module, precision=precision, layer_precision=layers).recorded(record)


def _calibration_batches(ctx, cfg: ModeloptConfig) -> list:
    import torch

    from optimize.evaluate.generation import Tokens

    tokens = Tokens(ctx)
    texts = ctx.calibration().items[: cfg.calibration_samples]
    return [torch.tensor([tokens(t)[: cfg.max_tokens]]) for t in texts if len(tokens(t)) > 1]


def quantized_linears(module) -> dict:
    """Linear layers whose weight quantizer is on (quantized) or off (kept in the source precision)."""
    on: list[str] = []
    off: list[str] = []
    for name, sub in module.named_modules():
        quantizer = getattr(sub, "weight_quantizer", None)
        if quantizer is not None:
            (on if quantizer.is_enabled else off).append(name)
    return {
        "quantized": {"count": len(on), "nodes": _kinds(on)},
        "kept_fp32": {"count": len(off), "nodes": _kinds(off)},
    }


def _kinds(names: list[str]) -> list[str]:
    import re

    return sorted(dict.fromkeys(re.sub(r"layers\.\d+", "layers.*", n) for n in names))


for _name, (_cfg_name, _cuda) in FORMATS.items():
    _register(_name, _cfg_name, _cuda)
