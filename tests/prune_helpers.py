"""Tiny random models and a stand-in pipeline context for the prune and distill tests."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
from omegaconf import OmegaConf

import torch

# One thread: tiny models on a shared 2-core machine spend their time in thread hand-offs otherwise.
torch.set_num_threads(1)

TEXTS = [f"paragraph {i} " + "word " * (5 + i % 7) for i in range(48)]


def tiny_bert(layers: int = 4, heads: int = 4, ffn: int = 64):
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=ffn, max_position_embeddings=64)
    return BertModel(config).eval()


def tiny_llama(layers: int = 4, ffn: int = 64):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=ffn, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def encode(texts: list[str], length: int = 16) -> dict[str, np.ndarray]:
    """Deterministic token ids from the text (a stand-in tokenizer), the last few tokens padding."""
    rows = [[(sum(map(ord, t)) * (k + 3)) % 97 + 2 for k in range(length)] for t in texts]
    mask = np.ones((len(texts), length), dtype=np.int64)
    mask[:, -3:] = 0
    return {"input_ids": np.array(rows, dtype=np.int64), "attention_mask": mask,
            "token_type_ids": np.zeros((len(texts), length), dtype=np.int64)}


class FakeContext:
    """What prune and distill use of Context, without loading a recipe."""

    def __init__(self, teacher, tmp: Path, prune_params: dict | None = None):
        self.source = SimpleNamespace(module=teacher, location=str(tmp / "teacher"), tokenizer_dir=None, kind="hf",
                                      gguf_file=None)
        self.cfg = OmegaConf.create({"prune": {"method": "structured", "params": prune_params or {}}})
        self.scratch = tmp
        self.records: dict = {}
        self.extra_files: dict = {}
        self.metric_hooks: list = []
        self.pooling = {"mode": "mean", "normalize": False}

    def calibration(self):
        return SimpleNamespace(items=TEXTS, describe=lambda: {"sha256": "fake", "count": len(TEXTS)})

    def encode(self, texts):
        return encode(texts)

    def record(self, stage: str, info: dict) -> None:
        self.records.setdefault("stages", {})[stage] = info


def torch_model(module, task: str = "sentence_embedding"):
    from optimize.context import Model

    return Model("torch", task, module=module)
