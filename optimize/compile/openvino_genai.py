"""Engine stage for causal LMs: OpenVINO GenAI. The Hugging Face model is exported to a stateful
OpenVINO IR (KV cache held inside the model, weights FP32), its tokenizer converted with
openvino_tokenizers, then NNCF compresses the weights (INT4 in groups with an INT8 remainder, or
INT8), optionally data-aware (AWQ, scale estimation, GPTQ, LoRA correction, layers kept at 8 bits
ranked by their activations) on the recipe's calibration text.
`openvino_genai.LLMPipeline` runs the result (engines/openvino/genai_runner.py).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, List, Optional

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
ENGINE_DIR = "openvino_genai"
WEIGHT_FORMATS = ("int4_sym", "int4_asym", "int8_asym", "fp32")
MAX_ACTIVATION_GROUP = 1 << 16  # wider than any layer's input: a larger group is a typo


@dataclass
class OVGenAIConfig:
    """Example recipe (asymmetric INT4 in groups of 64, every weight MatMul at 4 bits except what NNCF
    keeps at 8: the embedding and LM head):

        engine:
          method: openvino_genai
          params: {weight_format: int4_asym, group_size: 64, ratio: 1.0}

    group_size must divide the model's hidden size (SmolLM2's 576: 32 or 64, not 128).
    """

    weight_format: str = "int4_asym"  # int4_sym | int4_asym | int8_asym | fp32 (no compression)
    group_size: int = 64  # input channels per INT4 scale; -1: one scale per output channel
    ratio: float = 1.0  # share of the weight MatMuls at INT4 (NNCF ranks them); the rest INT8
    # Data-aware INT4 (calibrated on the recipe's calibration text)
    awq: bool = False
    scale_estimation: bool = False
    gptq: bool = False
    # Low-rank INT8 adapters fitted to what 4 bits lost in each layer (NNCF LoRA correction; not with
    # gptq): SmolLM2 +9.4% perplexity with AWQ + scale estimation, where they alone gave +15.4%, for
    # 0.77x the decode speed (two more MatMuls a layer).
    lora_correction: bool = False
    lora_adapter_rank: int = 8
    # How NNCF ranks the weights kept at 8 bits when ratio < 1: weight_quantization_error (data-free),
    # or one read from the calibration activations (hessian_input_activation, mean_activation_variance,
    # max_activation_variance, mean_activation_magnitude). null: NNCF's default for the settings.
    sensitivity_metric: Optional[str] = None
    calibration_samples: int = 32  # calibration texts, each one sequence
    max_tokens: int = 256  # tokens per calibration text
    ignored_names: List[str] = field(default_factory=list)  # weight MatMuls kept FP32 (OpenVINO node names)
    inference_precision: str = "f32"  # f32 | bf16 (refused on CPUs without native bf16)
    # The KV cache the artifact serves with, and is scored with (perplexity, lm-eval): null (as
    # inference_precision) | f32 | bf16 | f16 | u8 (the CPU plugin's default: keys by channel, values by
    # token) | u4. u8 holds about 3.4x the tokens per GB of f32 (head width 64).
    kv_cache_precision: Optional[str] = None
    kv_cache_group_size: int = 0  # u8/u4 values: channels per scale; 0: the head's width
    # Prompt lookup (n-gram speculation from the prompt) in the served engine: pays where answers quote
    # their prompt, at low concurrency. `python -m serve --prompt-lookup/--no-prompt-lookup` overrides.
    prompt_lookup: bool = False
    num_assistant_tokens: int = 5  # tokens proposed per decode step
    max_ngram_size: int = 3  # longest prompt n-gram matched
    # The CPU plugin's dynamic quantization of activations beside the compressed weights: null (the
    # plugin's default: INT8 in groups), 0 (f32 activations) or a group size, written into the IR.
    # With prompt lookup null means 0: a verification pass quantizes several tokens' activations
    # where plain decoding quantizes one's, and near-ties flip (SmolLM2 INT8, 8 grounded requests:
    # 5 of 8 greedy texts identical to the plain engine's with the default, 8 of 8 with 0).
    dynamic_quantization_group_size: Optional[int] = None

    @property
    def activation_groups(self) -> Optional[int]:
        """The dynamic quantization group size the IR records (None: the plugin's default)."""
        if self.dynamic_quantization_group_size is None and self.prompt_lookup:
            return 0
        return self.dynamic_quantization_group_size

    @property
    def int4(self) -> bool:
        return self.weight_format.startswith("int4")

    @property
    def data_aware(self) -> bool:
        from engines.openvino.genai_compress import needs_data

        return needs_data(self.awq, self.scale_estimation, self.gptq, self.lora_correction, self.sensitivity_metric)

    def validate(self):
        if self.weight_format not in WEIGHT_FORMATS:
            raise RecipeError(f"engine.params.weight_format={self.weight_format} (use {', '.join(WEIGHT_FORMATS)})")
        if self.group_size != -1 and self.group_size < 1:
            raise RecipeError(f"engine.params.group_size={self.group_size} (a positive channel count, or -1)")
        if not 0 < self.ratio <= 1:
            raise RecipeError(f"engine.params.ratio={self.ratio} (a share of the layers in (0, 1])")
        if self.data_aware and not self.int4:
            raise RecipeError(
                "engine.params.awq/scale_estimation/gptq/lora_correction/sensitivity_metric"
                " apply to int4 weight formats only"
            )
        from engines.openvino.genai_compress import SENSITIVITY_METRICS

        if self.sensitivity_metric is not None and self.sensitivity_metric not in SENSITIVITY_METRICS:
            raise RecipeError(
                f"engine.params.sensitivity_metric={self.sensitivity_metric} (use {', '.join(SENSITIVITY_METRICS)})"
            )
        if self.gptq and self.lora_correction:
            raise RecipeError("engine.params.gptq and lora_correction do not combine in NNCF: choose one")
        if self.lora_adapter_rank < 1:
            raise RecipeError(f"engine.params.lora_adapter_rank={self.lora_adapter_rank} (a positive rank)")
        if self.calibration_samples < 1 or self.max_tokens < 2:
            raise RecipeError("engine.params.calibration_samples must be >= 1 and max_tokens >= 2")
        if self.inference_precision not in ("f32", "bf16"):
            raise RecipeError(f"engine.params.inference_precision={self.inference_precision} (use f32 or bf16)")
        from engines.openvino.genai_runner import resolve_kv_precision

        try:
            resolve_kv_precision(self.inference_precision, self.kv_cache_precision)
        except ValueError as exc:
            raise RecipeError(f"engine.params.kv_cache_precision={self.kv_cache_precision}: {exc}") from None
        if self.kv_cache_group_size < 0:
            raise RecipeError(f"engine.params.kv_cache_group_size={self.kv_cache_group_size} (channels, or 0)")
        if self.num_assistant_tokens < 1 or self.max_ngram_size < 1:
            raise RecipeError("engine.params.num_assistant_tokens and max_ngram_size must be >= 1")
        groups = self.dynamic_quantization_group_size
        if groups is not None and not 0 <= groups <= MAX_ACTIVATION_GROUP:
            raise RecipeError(
                f"engine.params.dynamic_quantization_group_size={self.dynamic_quantization_group_size}"
                f" (channels per group up to {MAX_ACTIVATION_GROUP}, 0 for f32 activations, or null)"
            )
        from engines.openvino.runner import openvino_missing

        packages = {
            "openvino": "openvino",
            "openvino_genai": "openvino-genai",
            "openvino_tokenizers": "openvino-tokenizers",
            **({"nncf": "nncf"} if self.weight_format != "fp32" else {}),
        }
        missing = openvino_missing(packages, bf16=self.inference_precision == "bf16")
        if missing:  # checked before any weights load
            raise RecipeError(f"engine.method=openvino_genai inference_precision={self.inference_precision}: {missing}")

    def serving(self) -> dict:
        """The engine block's serving settings: the KV cache (always named: the CPU plugin's default
        differs by CPU) and prompt lookup where on."""
        out: dict[str, Any] = {"kv_cache_precision": self.kv_cache_precision or self.inference_precision}
        if self.kv_cache_group_size:
            out["kv_cache_group_size"] = self.kv_cache_group_size
        if self.prompt_lookup:
            out["prompt_lookup"] = {
                "num_assistant_tokens": self.num_assistant_tokens,
                "max_ngram_size": self.max_ngram_size,
            }
        return out

    @property
    def precision(self) -> str:
        """The artifact's precision: the weights' where compressed, the inference precision otherwise."""
        if self.weight_format == "fp32":
            return "bf16" if self.inference_precision == "bf16" else "fp32"
        return self.weight_format.split("_")[0]


@register(
    "engine",
    "openvino_genai",
    OVGenAIConfig,
    input_format="torch",
    tasks=("causal_lm",),
    needs_calibration=True,
    engine_formats=(formats.OPENVINO_GENAI,),
)
def openvino_genai_engine(model: Model, cfg: OVGenAIConfig, ctx: Context) -> Model:
    """OpenVINO GenAI: stateful IR with KV cache, NNCF weight-only INT4/INT8, LLMPipeline decoding."""
    if model.kind != "torch":
        raise RecipeError("engine.method=openvino_genai needs a Hugging Face causal LM")
    _refuse_architecture(model)
    _refuse_kv_group(model, cfg)
    from engines.openvino.genai_build import ExportError, export_stateful_lm
    from engines.openvino.genai_compress import CompressionError, compress_weights, weight_precision

    source_dir = _source_folder(model, ctx)
    out = ctx.scratch / "openvino_genai_engine"
    shutil.rmtree(out, ignore_errors=True)
    try:
        xml = export_stateful_lm(source_dir, out / "fp32")
    except ExportError as exc:
        raise RecipeError(f"engine.method=openvino_genai: {exc}") from None
    record: dict = {
        "method": "openvino_genai",
        "weight_format": cfg.weight_format,
        "openvino": metadata.version("openvino"),
        "openvino_genai": metadata.version("openvino-genai"),
        "inference_precision": cfg.inference_precision,
        **cfg.serving(),
    }
    if cfg.weight_format == "fp32":
        final = xml.parent
    else:
        batches = _calibration_batches(ctx, cfg) if cfg.data_aware else None
        log.info(
            "NNCF %s (group %d, ratio %.2f%s)",
            cfg.weight_format,
            cfg.group_size,
            cfg.ratio,
            f", data-aware on {len(batches)} texts" if batches else "",
        )
        try:
            xml = compress_weights(
                xml,
                out / "compressed",
                mode=cfg.weight_format,
                group_size=cfg.group_size,
                ratio=cfg.ratio,
                awq=cfg.awq,
                scale_estimation=cfg.scale_estimation,
                gptq=cfg.gptq,
                lora_correction=cfg.lora_correction,
                lora_adapter_rank=cfg.lora_adapter_rank,
                sensitivity_metric=cfg.sensitivity_metric,
                calibration_batches=batches,
                ignored_scope={"names": cfg.ignored_names} if cfg.ignored_names else None,
            )
        except CompressionError as exc:
            raise RecipeError(f"engine.method=openvino_genai: {exc}") from None
        shutil.rmtree(out / "fp32", ignore_errors=True)
        final = xml.parent
        record["nncf"] = _nncf_record(cfg, len(batches) if batches else 0)
    shutil.move(str(final), str(out / ENGINE_DIR))
    record.update(_finish_ir(out / ENGINE_DIR / xml.name, cfg.activation_groups))
    layers = weight_precision(out / ENGINE_DIR / xml.name)
    record["layer_precision"] = layers
    # The KV cache and prompt lookup as the engine block says are what scoring (optimize/tasks) and
    # serve both load: the gate's perplexity is the served cache's.
    engine = {"format": formats.OPENVINO_GENAI, "dir": ENGINE_DIR, "inference_precision": cfg.inference_precision}
    engine.update(cfg.serving())
    built = model.with_engine(out, engine, precision=cfg.precision)
    return dataclasses.replace(built, layer_precision=layers).recorded(record)


def _finish_ir(xml, activation_groups: Optional[int]) -> dict:
    """The saved IR rewritten once: each layer's q, k, v and its gate, up fused into one MatMul each
    (the same weights, fewer FullyConnected calls a decode step: engines/openvino/fuse_projections.py),
    and the activations' dynamic quantization written into its runtime options where set. Returns
    what the engine record says of it."""
    from engines.openvino.fuse_projections import fuse_projections
    from engines.openvino.genai_build import rewrite_ir, set_activation_quantization

    def change(ov_model) -> dict:
        done: dict[str, Any] = {"fused_projections": fuse_projections(ov_model).record()}
        if activation_groups is not None:
            set_activation_quantization(ov_model, activation_groups)
            done["dynamic_quantization_group_size"] = activation_groups
        return done

    return rewrite_ir(xml, change)


def _nncf_record(cfg: OVGenAIConfig, calibration_texts: int) -> dict:
    info: dict[str, Any] = {
        "nncf": metadata.version("nncf"),
        "mode": cfg.weight_format,
        "ignored_names": cfg.ignored_names,
    }
    if cfg.int4:
        info.update(
            group_size=cfg.group_size,
            ratio=cfg.ratio,
            awq=cfg.awq,
            scale_estimation=cfg.scale_estimation,
            gptq=cfg.gptq,
            lora_correction=cfg.lora_correction,
            sensitivity_metric=cfg.sensitivity_metric,
            backup_mode="int8_asym",
        )
        if cfg.lora_correction:
            info["lora_adapter_rank"] = cfg.lora_adapter_rank
        if cfg.data_aware:
            info.update(calibration_texts=calibration_texts, max_tokens=cfg.max_tokens)
    return info


def _calibration_batches(ctx, cfg: OVGenAIConfig) -> list[dict]:
    """Model inputs from the recipe's calibration text: each text's first max_tokens tokens as one
    sequence (tokenized by the artifact's own tokenizer)."""
    from engines.openvino.genai_compress import calibration_inputs
    from optimize.evaluate.generation import Tokens

    tokens = Tokens(ctx)
    texts = ctx.calibration().items[: cfg.calibration_samples]
    batches = calibration_inputs(tokens(text)[: cfg.max_tokens] for text in texts)
    if not batches:
        raise RecipeError("engine.method=openvino_genai: the calibration texts gave no sequence of 2 or more tokens")
    return batches


def _source_folder(model, ctx) -> Path:
    """A Hugging Face folder to export: the (cached) source, or the module a torch-side method changed
    saved with the source's tokenizer files."""
    from optimize.sources.models import hf_folder

    if model.module is ctx.source.module:
        return hf_folder(ctx.source)
    folder = ctx.scratch / "openvino_genai_input"
    shutil.rmtree(folder, ignore_errors=True)
    model.module.save_pretrained(str(folder))
    for path in hf_folder(ctx.source).glob("*"):
        if path.suffix in (".json", ".jinja", ".txt", ".model") and path.name != "config.json":
            shutil.copy2(path, folder / path.name)
    return folder


def _refuse_kv_group(model, cfg: OVGenAIConfig) -> None:
    """A KV-cache group size the model's heads cannot take, before any conversion: one line, exit 2."""
    from engines.openvino.genai_runner import check_kv_group

    try:
        check_kv_group(model.module.config.to_dict(), cfg.kv_cache_group_size)
    except ValueError as exc:
        raise RecipeError(f"engine.params.{exc}") from None


def _refuse_architecture(model) -> None:
    """The architecture table (engines/lm_archs.py) before any conversion: one line, exit 2."""
    from engines.lm_archs import refusal

    reason = refusal("openvino_genai", model.module.config)
    if reason:
        raise RecipeError(f"engine.method=openvino_genai: {reason}")
