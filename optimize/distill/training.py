"""The training loop (AdamW, bounded by steps and seconds, a learning-rate schedule), its
checkpoints under $OPTIMIZE_CACHE/distill/<key>/ for resuming, and the loss curve."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from optimize.distill.config import RUN_BOUNDS, DistillConfig
from optimize.distill.data import Batches

log = logging.getLogger(__name__)


def loss_summary(losses: list[float]) -> dict:
    """First and last five-step means (single steps are noisy: every batch is different)."""
    if not losses:
        return {}
    return {
        "first5_mean": sum(losses[:5]) / len(losses[:5]),
        "last5_mean": sum(losses[-5:]) / len(losses[-5:]),
        "min": min(losses),
        "steps": len(losses),
    }


# ---------------------------------------------------------------- training loop with checkpoints


def checkpoint_dir(ctx, cfg: DistillConfig) -> Path:
    """$OPTIMIZE_CACHE/distill/<sha256 of (source hash, prune + distill config, calibration hash)>."""
    from optimize.sources.models import cache_root, source_hash

    config = {k: v for k, v in asdict(cfg).items() if k not in RUN_BOUNDS}
    identity = {
        "source": source_hash(ctx.source) or ctx.source.location,
        "prune": ctx.plan.prune.record(),
        "distill": config,
        "calibration": ctx.calibration().describe(),
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_root() / "distill" / key


def train(student, objective, batches: Batches, cfg: DistillConfig, folder: Path) -> dict:
    """AdamW until max_steps or max_seconds; checkpoints every checkpoint_every steps and at the end."""
    import torch
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=cfg.lr)
    state = load_checkpoint(folder, student, optimizer) if cfg.resume else None
    step, losses = (state["step"], state["losses"]) if state else (0, [])
    earlier_seconds = state.get("seconds", 0.0) if state else 0.0  # training time before a resume
    resumed_from, started, stopped_by = step, time.monotonic(), "max_steps"

    def seconds() -> float:
        return earlier_seconds + time.monotonic() - started

    # The student trains in eval mode (dropout off): it imitates the teacher's deterministic
    # outputs, and a resumed run reproduces an uninterrupted one exactly.
    student.eval()
    bar = tqdm(total=cfg.max_steps, initial=step, desc="distill", unit="step", mininterval=2)
    while step < cfg.max_steps:
        if cfg.max_seconds is not None and seconds() > cfg.max_seconds:
            stopped_by = "max_seconds"
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, progress(cfg, step, seconds()))
        total, parts = objective.loss(batches.batch(step))
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        step += 1
        losses.append(round(float(total.detach()), 6))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", **{k: f"{v:.4f}" for k, v in parts.items()})
        if step % cfg.checkpoint_every == 0:
            save_checkpoint(folder, student, optimizer, step, losses, seconds())
    bar.close()
    if step > resumed_from:
        save_checkpoint(folder, student, optimizer, step, losses, seconds())
    student.eval()
    return {
        "steps": step,
        "resumed_from_step": resumed_from,
        "stopped_by": stopped_by,
        "train_seconds": round(time.monotonic() - started, 1),
        "checkpoint": str(folder),
        "losses": losses,
    }


def progress(cfg: DistillConfig, step: int, seconds: float) -> float:
    """How far through the run (0..1): whichever bound, steps or wall time, is nearer."""
    done = step / cfg.max_steps
    if cfg.max_seconds is not None:
        done = max(done, seconds / cfg.max_seconds)
    return min(done, 1.0)


def learning_rate(cfg: DistillConfig, done: float) -> float:
    """The schedule at `done` of the run: linear warm-up over `warmup`, then constant, cosine or
    linear decay to zero (a decayed rate ends nearer the minimum than a constant one, which keeps
    bouncing around it at the last steps)."""
    import math

    if done < cfg.warmup:
        return cfg.lr * (done + 1e-3) / cfg.warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    rest = (done - cfg.warmup) / (1 - cfg.warmup)
    return cfg.lr * (0.5 * (1 + math.cos(math.pi * rest)) if cfg.lr_schedule == "cosine" else 1 - rest)


def save_checkpoint(folder: Path, student, optimizer, step: int, losses: list[float], seconds: float) -> None:
    """Weights as safetensors, optimizer tensors with torch.save (loaded weights_only), step, losses
    and training seconds as JSON; written to a temp dir and renamed so a kill mid-save leaves the old one intact."""
    import shutil

    import torch
    from safetensors.torch import save_model

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(student, str(tmp / "student.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "losses": losses, "seconds": round(seconds, 3)}))
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder: Path, student, optimizer) -> Optional[dict]:
    import torch
    from safetensors.torch import load_model

    if not (folder / "state.json").is_file():
        return None
    load_model(student, str(folder / "student.safetensors"))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    state = json.loads((folder / "state.json").read_text())
    log.info("distill: resuming from step %d (%s)", state["step"], folder)
    return state


def plot_losses(losses: list[float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("distillation loss")
    ax.set_yscale("log" if losses and min(losses) > 0 else "linear")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
