"""engines/lm_archs.py on configs as the pipeline holds them: a model loaded from a GGUF file has a
config built in memory that names no `architectures`, and must not be refused for it."""

from __future__ import annotations

from engines.lm_archs import refusal


def test_a_config_without_architectures_is_judged_by_its_model_type():
    from transformers import LlamaConfig, MambaConfig

    llama = LlamaConfig()
    llama.architectures = None  # as transformers builds it from a GGUF file's metadata
    assert refusal("onnxruntime_genai", llama) is None
    assert refusal("openvino_genai", llama) is None
    mamba = MambaConfig()
    assert (
        refusal("onnxruntime_genai", mamba) == "ONNX Runtime GenAI's builder has no graph for mamba (MambaForCausalLM)"
    )
    assert "keeps other state" in refusal("openvino_genai", mamba)
