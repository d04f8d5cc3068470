"""Integer weight quantization of a causal LM's Linears with the compressed-tensors library: the
schemes vLLM serves on CPU as well as GPU.

- `ct_int8_w8a8`: INT8 weights, one scale per output channel, symmetric; INT8 activations quantized
  per token at run time (dynamic, symmetric). vLLM runs it with oneDNN / VNNI INT8 GEMMs.
- `ct_int4_w4a16`: INT4 weights in groups of `group_size` input channels, symmetric; activations stay
  in the model's precision.

Scales come from each weight's own min/max (round-to-nearest; no calibration data), computed by
compressed-tensors' `calculate_qparams`, and the module is left in compressed-tensors' simulated
form: its forward rounds weights (and W8A8's activations) exactly as the saved checkpoint's integers
say. The `compressed_tensors_checkpoint` engine packs and saves it; the pipeline measures that saved
checkpoint reloaded, the same integers `vllm serve` loads (python -m optimize.export --to vllm).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from typing import List

from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

# method name -> compressed-tensors preset scheme
SCHEMES = {"ct_int8_w8a8": "W8A8", "ct_int4_w4a16": "W4A16"}
INSTALL = 'pip install "compressed-tensors>=0.17"  (the [vllm] extra)'
REQUIRES = (("compressed_tensors", INSTALL),)


@dataclass
class Int8W8A8Config:
    """Example recipe:

    quantize:
      method: ct_int8_w8a8
      params: {ignore: [lm_head]}
    """

    # Linears kept in the source precision: names, or "re:" regular expressions (compressed-tensors' syntax).
    ignore: List[str] = field(default_factory=lambda: ["lm_head"])


@dataclass
class Int4W4A16Config(Int8W8A8Config):
    """Example recipe:

    quantize:
      method: ct_int4_w4a16
      params: {group_size: 32}
    """

    # Input channels per scale; must divide every quantized Linear's input width. Symmetric only: the
    # asymmetric form's packed zero points do not reload in transformers 5.24 (shape mismatch), so the
    # pipeline could not measure the checkpoint it would ship.
    group_size: int = 32

    def validate(self):
        # vLLM's CPU INT4 kernel takes even group sizes; its packing needs 8 values per int32.
        if self.group_size < 8 or self.group_size % 8:
            raise RecipeError(f"quantize.params.group_size={self.group_size} (use a multiple of 8, e.g. 32 or 64)")


def _import_compressed_tensors():
    """Imported when the stage runs (not when the recipe is checked), so the recipe plans without it."""
    try:
        import compressed_tensors.quantization as ctq
    except ImportError as exc:
        raise RecipeError(
            f"compressed-tensors methods need the compressed-tensors package ({exc}): {INSTALL}"
        ) from None
    return ctq


@register("quantize", "ct_int8_w8a8", Int8W8A8Config, input_format="torch", tasks=("causal_lm",), requires=REQUIRES)
def int8_w8a8(model: Model, cfg: Int8W8A8Config, ctx: Context) -> Model:
    """compressed-tensors INT8 W8A8: per-channel weights, dynamic per-token activations (vLLM serves it)"""
    return quantize(model, cfg, ctx, "ct_int8_w8a8")


@register("quantize", "ct_int4_w4a16", Int4W4A16Config, input_format="torch", tasks=("causal_lm",), requires=REQUIRES)
def int4_w4a16(model: Model, cfg: Int4W4A16Config, ctx: Context) -> Model:
    """compressed-tensors INT4 W4A16: group-wise weights, activations unquantized (vLLM serves it)"""
    return quantize(model, cfg, ctx, "ct_int4_w4a16")


def quantization_config(name: str, cfg):
    """The compressed-tensors config for every Linear but the ignored ones."""
    ctq = _import_compressed_tensors()
    scheme = ctq.preset_name_to_scheme(SCHEMES[name], ["Linear"])
    if isinstance(cfg, Int4W4A16Config):
        scheme.weights = scheme.weights.model_copy(update={"group_size": cfg.group_size})
    return ctq.QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=list(cfg.ignore),
        quantization_status=ctq.QuantizationStatus.FROZEN,
    )


def quantize(model: Model, cfg: Int8W8A8Config, ctx: Context, name: str) -> Model:
    """Attach the scheme to a copy of the module (the baseline keeps the original) and set each weight's
    scale (and zero point) from its min/max."""
    if model.kind != "torch" or model.module is None:
        raise RecipeError(f"quantize.method={name} needs the PyTorch model (it runs before the engine)")
    ctq = _import_compressed_tensors()
    module = plain_copy(model.module)
    config = quantization_config(name, cfg)
    ctq.apply_quantization_config(module, config, show_progress=False)
    quantized = {n: m for n, m in module.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    if not quantized:
        raise RecipeError(f"quantize.method={name}: no Linear layer is left to quantize (quantize.params.ignore)")
    for layer_name, layer in quantized.items():
        _set_weight_qparams(layer_name, layer)
    precision = name.removeprefix("ct_")
    layers = quantized_linears(module, quantized)
    record = {
        "method": name,
        "library": "compressed-tensors",
        "scheme": config.config_groups["group_0"].model_dump(mode="json", exclude_none=True),
        "ignore": list(cfg.ignore),
        "simulated": True,
        "layer_precision": layers,
    }
    return dataclasses.replace(model, module=module, precision=precision, layer_precision=layers).recorded(record)


def plain_copy(module):
    """An FP32 copy of the module without another library's quantization_config: a GGUF-loaded model
    (dequantized on load) carries one, and save_pretrained refuses it ("quantized with gguf")."""
    if not getattr(module, "is_quantized", False):
        return copy.deepcopy(module).float().eval()
    import torch
    from transformers import AutoModelForCausalLM

    config = module.config.__class__.from_dict(module.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(module.state_dict())
    if getattr(module, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(module.generation_config)
    return plain.eval()


def _set_weight_qparams(layer_name: str, layer) -> None:
    """Round-to-nearest scales from the weight's own range: per output channel, or per group of inputs."""
    import torch
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = layer.quantization_scheme.weights
    weight = layer.weight.data
    with torch.no_grad():
        if args.strategy == "group":
            if weight.shape[1] % args.group_size:
                raise RecipeError(
                    f"quantize.params.group_size={args.group_size} does not divide {layer_name}'s "
                    f"{weight.shape[1]} inputs (add it to quantize.params.ignore or pick another group size)"
                )
            groups = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = groups.amin(-1), groups.amax(-1)
        else:
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        scale, zero_point = calculate_qparams(low, high, args)
        layer.weight_scale.data.copy_(scale.to(layer.weight_scale.dtype))
        if getattr(layer, "weight_zero_point", None) is not None:
            layer.weight_zero_point.data.copy_(zero_point.to(layer.weight_zero_point.dtype))


def quantized_linears(module, quantized: dict) -> dict:
    """Linear layers quantized, and those kept in the source precision (the ignored ones)."""
    import torch

    kept = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and n not in quantized]
    return {
        "quantized": {"count": len(quantized), "nodes": _kinds(list(quantized))},
        "kept_fp32": {"count": len(kept), "nodes": _kinds(kept)},
    }


def _kinds(names: list[str]) -> list[str]:
    return sorted(dict.fromkeys(re.sub(r"layers\.\d+", "layers.*", n) for n in names))
