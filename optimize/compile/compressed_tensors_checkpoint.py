"""Engine: a compressed-tensors quantized causal LM saved as the Hugging Face checkpoint vLLM loads
(packed integer weights, their scales, config.json with the compressed-tensors quantization_config).

The pipeline measures that saved checkpoint reloaded by transformers (engines/pytorch/compressed_tensors_runner.py:
the integers dequantized and computed in FP32, W8A8's activations rounded per token), so what the gate
judged is what `python -m optimize.export ARTIFACT --to vllm DIR` hands to `vllm serve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

ENGINE_DIR = "checkpoint"


@dataclass
class CompressedCheckpointConfig:
    """Example recipe:

    engine:
      method: compressed_tensors_checkpoint
    """


@register(
    "engine",
    "compressed_tensors_checkpoint",
    CompressedCheckpointConfig,
    input_format="torch",
    tasks=("causal_lm",),
    engine_formats=(formats.COMPRESSED_TENSORS,),
    requires=(("compressed_tensors", 'pip install "compressed-tensors>=0.17"  (the [vllm] extra)'),),
)
def compressed_tensors_checkpoint(model: Model, cfg: CompressedCheckpointConfig, ctx: Context) -> Model:
    """Pack and save the compressed-tensors quantized module as a Hugging Face checkpoint (vLLM's format)."""
    if model.kind != "torch" or not _is_quantized(model.module):
        raise RecipeError("engine.method=compressed_tensors_checkpoint needs a ct_* quantize method before it")
    out = ctx.scratch / "compressed_tensors_engine"
    folder = out / ENGINE_DIR
    written = save_compressed(model.module, folder)
    engine = {"format": formats.COMPRESSED_TENSORS, "dir": ENGINE_DIR, "simulated": True}
    record = {"method": "compressed_tensors_checkpoint", **written}
    return model.with_engine(out, engine, precision=model.precision).recorded(record)


def _is_quantized(module) -> bool:
    """A compressed-tensors scheme is attached to at least one layer (what the ct_* methods leave)."""
    return any(getattr(m, "quantization_scheme", None) is not None for m in module.modules())


def save_compressed(module, folder: Path) -> dict:
    """compressed-tensors' save path on a copy, so the module the stage was given stays simulated:
    ModelCompressor rebuilds the quantization config from the schemes on the layers, packs the weights
    in memory, and writes the config into config.json after save_pretrained."""
    import copy

    import compressed_tensors
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor

    packed = copy.deepcopy(module)
    compressor = ModelCompressor.from_pretrained_model(packed)
    compressor.compress_model(packed)
    folder.mkdir(parents=True, exist_ok=True)
    packed.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    generation = getattr(packed, "generation_config", None)
    if generation is not None and not (folder / "generation_config.json").exists():
        generation.save_pretrained(str(folder))
    quantization = compressor.quantization_config
    return {
        "format": quantization.format if quantization is not None else None,
        "compressed_tensors": compressed_tensors.__version__,
    }
