"""Train a small full-precision Llama on the calibration split of the Python prose that ships with
CPython (pydoc topics and standard-library docstrings), with its own byte-level BPE tokenizer.

    python -m optimize.train_tiny_lm OUT [--hidden 256] [--layers 4] [--steps 600] [--seed 0]

Writes a Hugging Face folder (config, model.safetensors, tokenizer, train.json) that
`model.source=OUT` loads. The held-out (evaluation) split is never trained on: it is what perplexity
is measured on. The point is a source that was never quantized, so INT4 methods can be compared from
full precision offline (a GGUF source is already 4-bit: quantizing it again measures two roundings).
About half an hour on 2 shared cores at the defaults; seconds at --hidden 128 --layers 2 --steps 150.
A model this small and this briefly trained loses almost nothing to any INT4 method (docs/figures.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = "<|endoftext|>"


def train_bpe(texts: list[str], vocab_size: int, out: Path, chat_template: str = CHAT_TEMPLATE) -> int:
    """A byte-level BPE trained on `texts`, saved to `out` as a fast tokenizer (one special token for
    bos, eos, unk and padding: id 0); returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[SPECIAL], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL, eos_token=SPECIAL, unk_token=SPECIAL, pad_token=SPECIAL
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def training_text() -> list[str]:
    from calibration import python_prose

    return python_prose("calibration")


def train(
    out: Path,
    hidden: int = 256,
    layers: int = 4,
    steps: int = 600,
    seed: int = 0,
    vocab_size: int = 2048,
    seq_len: int = 128,
    batch_size: int = 16,
    lr: float = 3e-3,
) -> dict:
    """Train and save; returns the training record (also written to OUT/train.json)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    texts = training_text()
    vocab = train_bpe(texts, vocab_size, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    stream = torch.tensor([i for t in texts for i in tokenizer(t + "\n\n")["input_ids"]])
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        intermediate_size=3 * hidden,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    generator = torch.Generator().manual_seed(seed)
    start, losses = time.perf_counter(), []
    model.train()
    for step in range(steps):
        offsets = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
        batch = torch.stack([stream[o : o + seq_len] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}/{steps}: loss {sum(losses[-100:]) / 100:.3f}", file=sys.stderr, flush=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    record = {
        "text": "python_prose, calibration split",
        "training_tokens": len(stream),
        "steps": steps,
        "batch": [batch_size, seq_len],
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "seconds": round(time.perf_counter() - start, 1),
        "seed": seed,
    }
    (out / "train.json").write_text(json.dumps(record, indent=2))
    return record


# Bounds that keep a typo from asking for a model this trainer is not for (it runs on a CPU).
MAX_HIDDEN, MAX_LAYERS, MAX_STEPS = 4096, 64, 1_000_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=256, help="width (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem:
        print(f"error: {problem} (nothing written)", file=sys.stderr)
        return 2
    # Trained into a sibling folder and renamed at the end: a failed or interrupted run leaves no
    # half-written model at OUT.
    partial = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        record = train(partial, args.hidden, args.layers, args.steps, args.seed)
        if args.out.exists():
            args.out.rmdir()  # empty, checked above
        partial.rename(args.out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(json.dumps(record))
    return 0


def _argument_problem(args) -> str | None:
    if not (64 <= args.hidden <= MAX_HIDDEN and args.hidden % 64 == 0):
        return f"--hidden must be a multiple of 64 up to {MAX_HIDDEN}"
    if not (1 <= args.layers <= MAX_LAYERS and 1 <= args.steps <= MAX_STEPS):
        return f"--layers and --steps at least 1 (at most {MAX_LAYERS} and {MAX_STEPS})"
    out = args.out
    if out.exists() and not out.is_dir():
        return f"{out} is a file, not a folder"
    if out.is_dir() and any(out.iterdir()):
        return f"{out} is not empty"
    parent = out.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        return f"{parent} is not a folder this user can write"
    return None


if __name__ == "__main__":
    sys.exit(main())
