"""Build a genuinely tiny causal-LM artifact: random-weight Llama (2 layers, width 64), a byte-level
BPE tokenizer trained on CPython's own docs, a chat template, converted by onnxruntime-genai's
builder, wrapped in a manifest that passes verification. Runs offline in about 20 s.

    python tests/serve/make_tiny_llm.py OUT_DIR
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def train_tokenizer(out: Path):
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(topics.values())[:20], trainer)
    special = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special, eos_token=special,
                                   unk_token=special, pad_token=special)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def save_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)


def write_manifest(artifact: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from engines.artifact import MANIFEST, SCHEMA_VERSION, file_table

    manifest = {
        "schema_version": SCHEMA_VERSION, "id": "tiny-llm-test", "parent_id": None,
        "recipe": {"name": "tiny_llm", "resolved": {"serve": {"max_queue": 8}}},
        "model": {"source": "random LlamaConfig (tests)", "task": "causal_lm"},
        "engine": {"format": "onnxruntime-genai", "dir": "genai", "precision": "fp32", "task": "causal_lm",
                   "tokenizer": "genai", "providers": ["CPUExecutionProvider"]},
        "gate": {"passed": True, "checks": []}, "verdict": "passed",
        "files": file_table(artifact),
    }
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=2))


def main(out: str) -> None:
    artifact = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        save_model(source, train_tokenizer(source))
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-m",
                        str(source), "-o", str(artifact / "genai"), "-p", "fp32", "-e", "cpu"],
                       check=True, capture_output=True, text=True)
    write_manifest(artifact)


if __name__ == "__main__":
    main(sys.argv[1])
