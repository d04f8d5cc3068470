"""Train a small full-precision Llama on the calibration split of the Python prose that ships with
CPython (pydoc topics and standard-library docstrings), with its own byte-level BPE tokenizer.

    python -m optimize.train.tiny_lm OUT [--hidden 256] [--layers 4] [--steps 600] [--seed 0]
    python -m optimize.train.tiny_lm OUT --from SOURCE [--steps 300] [--lr 1e-4]
    python -m optimize.train.tiny_lm OUT --from SOURCE --rotate [--steps 0] [--seed 0]

Writes a Hugging Face folder (config, model.safetensors, tokenizer, train.json) that
`model.source=OUT` loads. The held-out (evaluation) split is never trained on: it is what perplexity
is measured on. The point is a source that was never quantized, so INT4 methods can be compared from
full precision offline (a GGUF source is already 4-bit: quantizing it again measures two roundings).
About half an hour on 2 shared cores at the defaults; seconds at --hidden 128 --layers 2 --steps 150.
A model this small and this briefly trained loses almost nothing to any INT4 method (docs/figures-history.md).

With --from, an existing causal LM (anything `model.source` takes: a folder, a GGUF file, pkg://...)
is trained further on the same text in FP32 instead, and saved as a full-precision checkpoint of a
real model's size and shape. From a 4-bit file its weights stay near the file's grid: SmolLM2's Q4_1
weights moved a median 3% of their block's step in 150 steps at --lr 3e-4 (docs/figures-history.md), so INT4
methods compared on it are compared on a model that was 4-bit, not on one trained in full precision.

With --rotate the source's residual stream is first rotated by a random orthogonal matrix (--seed;
optimize/transforms/rotation.py): the same function in FP32 (checked on its logits), and every weight a mix of
hundreds of the source's, so none is left on a 4-bit grid. --steps 0 saves it without training. Its
caveat: rotation spreads outlier channels, which favours INT4, so a comparison on it ranks methods
rather than saying how much a model trained in full precision loses.
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
    return _fit(model, stream, out, steps, seed, seq_len, batch_size, lr, weight_decay=0.1)


def continue_training(
    out: Path,
    source: str,
    steps: int = 300,
    seed: int = 0,
    seq_len: int = 256,
    batch_size: int = 4,
    lr: float = 1e-4,
    rotate: bool = False,
) -> dict:
    """Train the causal LM at `source` further on the same text, in FP32, and save it with its own
    tokenizer; returns the record (OUT/train.json), which names the source and its sha256. A GGUF
    source is dequantized first (as the pipeline loads it): the result is its full-precision
    continuation. With `rotate` its residual stream is rotated first (seeded by `seed`); steps may
    then be 0. RecipeError for a source the pipeline would refuse or a model rotation cannot keep."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from optimize.config import ModelConfig
    from optimize.sources import models

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    loaded = models.load(OmegaConf.structured(ModelConfig(source=source, task="causal_lm", max_length=seq_len)))
    model = models.dequantized_copy(loaded.module) if loaded.gguf_file else loaded.module
    tokenizer = AutoTokenizer.from_pretrained(loaded.location, gguf_file=loaded.gguf_file)
    tokenizer.save_pretrained(out)
    rotated = _rotated(model, seed) if rotate else None
    if steps:
        stream = torch.tensor([i for t in training_text() for i in tokenizer(t + "\n\n")["input_ids"]])
        record = _fit(model, stream, out, steps, seed, seq_len, batch_size, lr, weight_decay=0.0)
    else:
        model.eval().save_pretrained(out, safe_serialization=True)
        record = {"steps": 0, "parameters": sum(p.numel() for p in model.parameters())}
    record["from"] = {"source": source, "sha256": models.source_hash(loaded)}
    if rotated is not None:
        record["rotated"] = rotated
    (out / "train.json").write_text(json.dumps(record, indent=2))
    return record


def _rotated(model, seed: int) -> dict:
    """Rotate the model's residual stream (optimize/transforms/rotation.py); its record."""
    from optimize.errors import RecipeError
    from optimize.transforms.rotation import RotationError, rotate_residual

    try:
        difference = rotate_residual(model, seed)
    except RotationError as exc:
        raise RecipeError(f"--rotate: {exc}") from None
    return {"seed": seed, "max_logit_difference_over_spread": difference}


def _fit(model, stream, out: Path, steps, seed, seq_len, batch_size, lr, weight_decay) -> dict:
    """AdamW with warm-up and cosine decay on random windows of the token stream; saves the model
    (safetensors) and OUT/train.json, and returns the record."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
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
        if (step + 1) % 100 == 0 or step + 1 == steps:
            recent = losses[-100:]
            print(f"step {step + 1}/{steps}: loss {sum(recent) / len(recent):.3f}", file=sys.stderr, flush=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    record = {
        "text": "python_prose, calibration split",
        "training_tokens": len(stream),
        "steps": steps,
        "batch": [batch_size, seq_len],
        "lr": lr,
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
    parser.add_argument("--steps", type=int, default=None, help="600 from scratch, 300 with --from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from", dest="source", help="train this causal LM further (what model.source takes)")
    parser.add_argument("--lr", type=float, default=None, help="3e-3 from scratch, 1e-4 with --from")
    parser.add_argument(
        "--rotate", action="store_true", help="with --from: rotate the residual stream first (the same function)"
    )
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem:
        print(f"error: {problem} (nothing written)", file=sys.stderr)
        return 2
    from optimize.errors import RecipeError

    # Trained into a sibling folder and renamed at the end: a failed or interrupted run leaves no
    # half-written model at OUT.
    partial = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        try:
            record = _run(args, partial)
        except RecipeError as exc:
            print(f"error: {exc} (nothing written)", file=sys.stderr)
            return 2
        if args.out.exists():
            args.out.rmdir()  # empty, checked above
        partial.rename(args.out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(json.dumps(record))
    return 0


def _run(args, out: Path) -> dict:
    if args.source:
        steps = 300 if args.steps is None else args.steps
        return continue_training(out, args.source, steps=steps, seed=args.seed, lr=args.lr or 1e-4, rotate=args.rotate)
    return train(out, args.hidden, args.layers, args.steps or 600, args.seed, lr=args.lr or 3e-3)


def _argument_problem(args) -> str | None:
    if not (64 <= args.hidden <= MAX_HIDDEN and args.hidden % 64 == 0):
        return f"--hidden must be a multiple of 64 up to {MAX_HIDDEN}"
    if not 0 <= args.seed < 2**63:  # torch's generators take a 64-bit seed
        return "--seed must be at least 0 and below 2**63"
    if args.rotate and not args.source:
        return "--rotate rotates a model given with --from"
    if args.rotate and args.steps == 0:
        pass  # a rotation alone
    elif not (args.steps is None or 1 <= args.steps <= MAX_STEPS):
        return f"--steps at least 1 (0 with --rotate) and at most {MAX_STEPS}"
    if not 1 <= args.layers <= MAX_LAYERS:
        return f"--layers at least 1 and at most {MAX_LAYERS}"
    if args.lr is not None and not (0 < args.lr <= 1):  # NaN fails both comparisons
        return "--lr must be above 0 and at most 1"
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
