"""Engine stage for causal LMs: ONNX Runtime GenAI's model builder (decoder with KV cache, tokenizer,
genai_config.json), weight-only INT4/INT8 MatMulNBits on CPU."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
ENGINE_DIR = "genai"
# The builder's own algorithms, and hqq: ONNX Runtime's HQQ quantizer run on the builder's fp32 model
# (engines/onnxruntime_genai/hqq.py; the LM head at 8 bits).
ALGOS = ("default", "rtn", "k_quant", "rtn_last", "k_quant_last", "k_quant_mixed", "hqq")


@dataclass
class GenAIConfig:
    """Example recipe (INT4 body, INT8 LM head, k-quant scales):

        engine:
          method: onnxruntime_genai
          params: {precision: int4, block_size: 32, algo_config: k_quant_last, accuracy_level: 4}

    The builder's options are named as in `python -m onnxruntime_genai.models.builder --extra_options`;
    `extra_options` passes any other KEY=VALUE through unchanged.
    """

    precision: str = "int4"  # int4 | int8 | fp32
    execution_provider: str = "cpu"
    block_size: int = 32
    is_symmetric: bool = True
    accuracy_level: Optional[int] = None  # 4: int8 activations inside MatMulNBits (CPU default), 1: fp32
    algo_config: str = "default"
    matmul_mixed_precision: Optional[str] = None  # e.g. "last_matmul:int8" (the LM head at 8 bits)
    nodes_to_exclude: List[str] = field(default_factory=list)  # stay FP32, e.g. ["/lm_head/MatMul"]
    extra_options: Dict[str, Any] = field(default_factory=dict)

    def validate(self):
        if self.precision not in ("int4", "int8", "fp32", "fp16"):
            raise RecipeError(f"engine.params.precision={self.precision} (use int4, int8, fp32 or fp16)")
        if self.algo_config not in ALGOS:
            raise RecipeError(f"engine.params.algo_config={self.algo_config} (use one of {', '.join(ALGOS)})")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise RecipeError(f"engine.params.block_size={self.block_size} (use 16, 32, 64, 128 or 256)")
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise RecipeError(f"engine.params.accuracy_level={self.accuracy_level} (use 1, 2, 3 or 4)")
        if self.hqq and (self.precision != "int4" or self.matmul_mixed_precision or self.nodes_to_exclude):
            raise RecipeError(
                "engine.params.algo_config=hqq takes precision int4 and no matmul_mixed_precision or nodes_to_exclude"
            )

    @property
    def hqq(self) -> bool:
        return self.algo_config == "hqq"

    def builder_options(self) -> list[str]:
        options = {
            "block_size": self.block_size,
            "is_symmetric": self.is_symmetric,
            "algo_config": self.algo_config,
            "accuracy_level": self.accuracy_level,
            "matmul_mixed_precision": self.matmul_mixed_precision,
            "nodes_to_exclude": ",".join(self.nodes_to_exclude) or None,
            **self.extra_options,
        }
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items() if v is not None]


@register(
    "engine",
    "onnxruntime_genai",
    GenAIConfig,
    input_format="torch",
    tasks=("causal_lm",),
    engine_formats=(formats.ONNXRUNTIME_GENAI,),
    requires=(("onnxruntime_genai", "pip install onnxruntime-genai"),),
)
def onnxruntime_genai_engine(model: Model, cfg: GenAIConfig, ctx: Context) -> Model:
    """Build an ONNX Runtime GenAI decoder with KV cache (weight-only INT4/INT8 via MatMulNBits)."""
    if model.kind != "torch":
        raise RecipeError("engine.method=onnxruntime_genai needs a Hugging Face causal LM")
    _refuse_architecture(model)
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise RecipeError(
            "engine.method=onnxruntime_genai needs onnxruntime-genai: pip install onnxruntime-genai"
        ) from None
    source_dir = _source_folder(model, ctx)
    out = ctx.scratch / "genai_engine"
    shutil.rmtree(out, ignore_errors=True)
    from engines.onnxruntime_genai.build import BuildError, build, weight_precision

    options = cfg.builder_options() if cfg.precision in ("int4", "int8") and not cfg.hqq else []
    built_precision = "fp32" if cfg.hqq else cfg.precision
    try:
        cache = ctx.scratch / "genai_cache"
        build(source_dir, out / ENGINE_DIR, built_precision, cfg.execution_provider, options, cache)
    except BuildError as exc:
        raise RecipeError(str(exc)) from None
    if cfg.hqq:
        from engines.onnxruntime_genai.hqq import HQQError, quantize_hqq

        try:
            quantize_hqq(out / ENGINE_DIR, cfg.block_size, head_bits=8, accuracy_level=cfg.accuracy_level)
        except HQQError as exc:
            raise RecipeError(f"engine.method=onnxruntime_genai: {exc}") from None
    layers = weight_precision(out / ENGINE_DIR / "model.onnx")
    record = {
        "method": "onnxruntime_genai",
        "builder_options": options,
        **({"hqq": {"block_size": cfg.block_size, "head_bits": 8}} if cfg.hqq else {}),
        "precision": cfg.precision,
        "layer_precision": layers,
    }
    engine = {"format": formats.ONNXRUNTIME_GENAI, "dir": ENGINE_DIR, "providers": [_provider(cfg.execution_provider)]}
    built = model.with_engine(out, engine, precision=cfg.precision)
    return dataclasses.replace(built, layer_precision=layers).recorded(record)


def _source_folder(model, ctx) -> Path:
    """The builder reads a Hugging Face folder: the (cached) source, or the module a torch-side method changed."""
    from optimize.sources.models import hf_folder

    if model.module is ctx.source.module:
        return hf_folder(ctx.source)
    folder = ctx.scratch / "genai_input"
    model.module.save_pretrained(str(folder))
    tokenizer_src = hf_folder(ctx.source)
    for path in tokenizer_src.glob("*"):
        if path.suffix in (".json", ".jinja", ".txt", ".model") and path.name not in ("config.json",):
            shutil.copy2(path, folder / path.name)
    return folder


def _provider(name: str) -> str:
    return {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}.get(name, name)


def _refuse_architecture(model) -> None:
    """The architecture table (engines/lm_archs.py) before any conversion: one line, exit 2."""
    from engines.lm_archs import refusal

    reason = refusal("onnxruntime_genai", model.module.config)
    if reason:
        raise RecipeError(f"engine.method=onnxruntime_genai: {reason}")
