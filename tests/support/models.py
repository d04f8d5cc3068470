"""Tiny random models, built in a second on CPU: a BERT encoder and a Llama decoder (in memory, or
saved as a folder with a small BPE tokenizer), and a stand-in tokenizer for the encoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# One thread: tiny models on a shared 2-core machine spend their time in thread hand-offs otherwise.
torch.set_num_threads(1)

TEXTS = [f"paragraph {i} " + "word " * (5 + i % 7) for i in range(48)]


def tiny_bert(layers: int = 4, heads: int = 4, ffn: int = 64):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=64,
    )
    return BertModel(config).eval()


def tiny_llama(
    layers: int = 4, ffn: int = 64, hidden: int = 32, vocab_size: int = 100, max_positions: int = 64, **config
):
    """A random Llama (4 query heads, 2 key/value heads, tied embeddings), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=ffn,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        **config,
    )
    return LlamaForCausalLM(config).eval()


def tiny_llama_folder(out: Path, max_positions: int = 512, hidden: int = 64, ffn: int = 128, layers: int = 2) -> Path:
    """A Hugging Face folder: a random Llama (2 layers of width 64 unless told; 256 fills K-quant
    super-blocks) and a byte-level BPE tokenizer trained on CPython's docs (with a chat template),
    token 0 for bos, eos and padding. Offline, a few seconds."""
    out = Path(out)
    vocab_size = train_tokenizer(out)
    model = tiny_llama(
        layers=layers,
        ffn=ffn,
        hidden=hidden,
        vocab_size=vocab_size,
        max_positions=max_positions,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


def train_tokenizer(out: Path) -> int:
    """Byte-level BPE (512 tokens) trained on CPython's docs, saved to `out`; returns the vocabulary size."""
    from pydoc_data.topics import topics

    from optimize.train.tiny_lm import train_bpe

    return train_bpe(list(topics.values())[:20], 512, out)


def encode(texts: list[str], length: int = 16) -> dict[str, np.ndarray]:
    """Deterministic token ids from the text (a stand-in tokenizer), the last few tokens padding."""
    rows = [[(sum(map(ord, t)) * (k + 3)) % 97 + 2 for k in range(length)] for t in texts]
    mask = np.ones((len(texts), length), dtype=np.int64)
    mask[:, -3:] = 0
    return {
        "input_ids": np.array(rows, dtype=np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((len(texts), length), dtype=np.int64),
    }


def torch_model(module, task: str = "sentence_embedding"):
    from optimize.context import Model

    return Model("torch", task, module=module)
