"""Which causal-LM architectures each LM engine takes: one table, asked before anything is built (the
race records a refusal as the candidate's outcome; an engine given alone exits 2 with it).

Checked on tiny random models of each architecture (tests/optimize/test_lm_architectures.py): every
engine's FP32 build scores the same log-likelihoods as transformers on the same tokens. What the
table refuses, it refuses for a measured reason, said in the message.
"""

from __future__ import annotations

from typing import Any, Optional

# The architectures tested end to end through every LM engine (transformers model_type).
TESTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")

# ONNX Runtime GenAI's builder (0.18) builds these causal-LM classes (its own dispatch, builder.py).
GENAI_CLASSES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "PhiForCausalLM",
        "GraniteForCausalLM",
        "OlmoForCausalLM",
        "NemotronForCausalLM",
        "SmolLM3ForCausalLM",
        "Ernie4_5ForCausalLM",
        "InternLM2ForCausalLM",
        "HunYuanDenseV1ForCausalLM",
    }
)
# Decoders whose state is not a key/value cache of one shape per layer, which the OpenVINO GenAI export
# (engines/openvino/genai_build.py: past key and value [batch, kv heads, tokens, head size] per layer)
# cannot lay out.
NOT_KV_CACHE = frozenset({"mamba", "mamba2", "falcon_mamba", "lfm2", "lfm2_moe", "jamba", "rwkv", "qwen3_next"})


def text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def causal_lm_classes(config: Any) -> list[str]:
    """The config's architectures; a config built in memory (a model loaded from a GGUF file) names
    none, and then the causal-LM class transformers maps its model_type to stands for it."""
    classes = list(getattr(config, "architectures", None) or [])
    if not classes:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""))
        classes = [mapped] if isinstance(mapped, str) else []
    return classes


def describe(config: Any) -> str:
    """'qwen2 (Qwen2ForCausalLM)': how messages name a model's architecture."""
    classes = causal_lm_classes(config)
    return f"{config.model_type} ({classes[0]})" if classes else str(config.model_type)


def refusal(engine: str, config: Any) -> Optional[str]:
    """None if `engine` takes this causal LM; else one line saying why not."""
    check = _CHECKS.get(engine)
    return check(config) if check else None


def _genai(config: Any) -> Optional[str]:
    classes = causal_lm_classes(config)
    if not classes or classes[0] not in GENAI_CLASSES:
        return f"ONNX Runtime GenAI's builder has no graph for {describe(config)}"
    return None


def _openvino_genai(config: Any) -> Optional[str]:
    if config.model_type in NOT_KV_CACHE:
        return f"the OpenVINO GenAI export needs a key/value cache per layer; {describe(config)} keeps other state"
    return None


_CHECKS = {"onnxruntime_genai": _genai, "openvino_genai": _openvino_genai}
