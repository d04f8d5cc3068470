"""Distill stage: train a student to match the teacher (the original source model) on calibration text.

Losses (weights and temperature from the recipe):
- output: causal LMs, KL(teacher || student) of the softened next-token distributions, times T^2
  (Hinton et al. 2015: keeps gradient scale independent of T); sentence encoders, 1 - cosine of
  the pooled sentence embeddings (the task's own output);
- hidden: MSE between student hidden states and the teacher layers they replace, divided by the
  teacher's mean square so every layer weighs alike whatever its scale. Student layer j maps to
  the teacher layer the prune stage kept at position j (uniform spacing otherwise); the student's
  last layer always maps to the teacher's last. `hidden_layers: last` compares only that pair.

The learning rate is constant or warms up and decays to zero (cosine or linear) over the run,
whose length is whichever bound, steps or seconds, comes first.

The student is what the prune stage produced, or (no prune stage) `student_layers` of the
teacher's layers, evenly spaced. Training is bounded by max_steps and max_seconds, shows a
progress bar, saves a loss curve PNG into the artifact, and checkpoints under
$OPTIMIZE_CACHE/distill/<key>/ (key: source hash, prune + distill config, calibration hash) so an
interrupted run resumes where it stopped.

Example recipe:

    distill:
      method: logit_hidden_kd
      params: {max_steps: 300, max_seconds: 480, batch_size: 16, seq_len: 128, lr: 1e-4}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
# Keys that bound a run rather than define it: a longer rerun resumes the same checkpoint (with a
# decaying learning rate, at the point of the schedule the new bounds put it).
RUN_BOUNDS = ("max_steps", "max_seconds", "checkpoint_every", "resume")
LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass
class DistillConfig:
    max_steps: int = 200
    max_seconds: Optional[float] = 600.0  # wall-time bound for training (null: steps only)
    batch_size: int = 16
    seq_len: int = 128  # tokens per sample (causal LMs: windows of the calibration token stream)
    lr: float = 1e-4
    # constant, or warm up linearly for `warmup` of the run and then decay to zero (cosine or linear);
    # the run's progress is the larger of steps/max_steps and seconds/max_seconds.
    lr_schedule: str = "constant"
    warmup: float = 0.0
    temperature: float = 2.0
    output_weight: float = 1.0  # logit KL (causal LMs) or 1 - embedding cosine (encoders)
    hidden_weight: float = 1.0
    # which student layers the hidden loss matches to their teacher layers: all, or only the last
    # (a 3-layer MiniLM student generalized better matching only its output states)
    hidden_layers: str = "all"
    student_layers: Optional[int] = None  # no prune stage: the student keeps this many teacher layers
    train_embeddings: bool = False  # frozen by default: they are the teacher's, and the largest tensors
    checkpoint_every: int = 50
    resume: bool = True
    seed: int = 0

    def validate(self):
        if self.max_steps < 1 or self.batch_size < 1 or self.seq_len < 2 or self.checkpoint_every < 1:
            raise RecipeError("distill.params: max_steps, batch_size, checkpoint_every must be >= 1, seq_len >= 2")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise RecipeError(f"distill.params.max_seconds={self.max_seconds}: must be positive (or null)")
        if self.temperature <= 0 or self.lr <= 0:
            raise RecipeError("distill.params.temperature and lr must be positive")
        if min(self.output_weight, self.hidden_weight) < 0 or self.output_weight + self.hidden_weight == 0:
            raise RecipeError("distill.params: output_weight and hidden_weight must be >= 0, not both 0")
        if self.hidden_layers not in ("all", "last"):
            raise RecipeError(f"distill.params.hidden_layers={self.hidden_layers} (use all or last)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise RecipeError(f"distill.params.lr_schedule={self.lr_schedule} (use {', '.join(LR_SCHEDULES)})")
        if not 0 <= self.warmup < 1:
            raise RecipeError(f"distill.params.warmup={self.warmup}: a fraction of the run, in [0, 1)")
        if self.student_layers is not None and self.student_layers < 1:
            raise RecipeError(f"distill.params.student_layers={self.student_layers}: keep at least 1")


@register(
    "distill",
    "logit_hidden_kd",
    DistillConfig,
    input_format="torch",
    needs_calibration=True,
    tasks=("sentence_embedding", "causal_lm"),
)
def logit_hidden_kd(model, cfg: DistillConfig, ctx):
    """Knowledge distillation from the source model: output (logit KL / embedding cosine) + hidden states."""
    import dataclasses

    import torch

    if model.kind != "torch":
        raise RecipeError("distill.method=logit_hidden_kd needs a PyTorch model (not an ONNX source)")
    torch.manual_seed(cfg.seed)
    teacher = ctx.source.module.eval()
    student, layer_map = make_student(model.module, teacher, cfg, ctx, model.kept_layers)
    objective = Objective.for_task(model.task, teacher, student, layer_map, cfg, ctx)
    batches = Batches.for_task(model.task, ctx, cfg)
    before = objective.before_training(student, ctx)
    objective.prepare(batches)
    run = train(student, objective, batches, cfg, checkpoint_dir(ctx, cfg))
    ctx.extra_files["distill/loss_curve.png"] = plot_losses(run["losses"], ctx.scratch / "distill_loss.png")
    ctx.record(
        "distill",
        {
            "method": "logit_hidden_kd",
            "layer_map": layer_map,
            **before,
            **{k: v for k, v in run.items() if k != "losses"},
            "loss_curve": "distill/loss_curve.png",
            "loss_curve_summary": loss_summary(run["losses"]),
        },
    )
    return dataclasses.replace(model, module=student.eval())


# ---------------------------------------------------------------- the student


def make_student(module, teacher, cfg: DistillConfig, ctx, kept_layers: list[int] | None = None):
    """(student, layer map). The prune stage's module is the student; without one, build it from
    `student_layers` evenly spaced teacher layers (a student larger than the teacher is an error)."""
    from optimize.surgery import Layout, evenly_spaced, keep_layers, student_copy

    teacher_layers = len(Layout(teacher).layers)
    if module is teacher:
        if cfg.student_layers is None:
            raise RecipeError("distill needs a student: add a prune stage or set distill.params.student_layers")
        if cfg.student_layers > teacher_layers:
            raise RecipeError(
                f"distill.params.student_layers={cfg.student_layers} is larger than the teacher "
                f"({teacher_layers} layers): the student must be smaller"
            )
        module = student_copy(teacher)
        kept = evenly_spaced(teacher_layers, cfg.student_layers)
        keep_layers(module, kept)
    else:
        if cfg.student_layers is not None:
            raise RecipeError(
                "distill.params.student_layers is for runs without a prune stage (the prune "
                "stage already made the student)"
            )
        kept = kept_layers or evenly_spaced(teacher_layers, len(Layout(module).layers))
    if _parameters(module) > _parameters(teacher):
        raise RecipeError("distill: the student is larger than the teacher")
    if not cfg.train_embeddings:  # (tied LM heads share this weight and stay frozen with it)
        module.get_input_embeddings().requires_grad_(False)
    return module.eval(), kept[:-1] + [teacher_layers - 1]


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------- data


class Batches:
    """batch(step) -> dict of int64 tensors; deterministic in the step, so a resumed run sees the
    same data it would have seen without the interruption."""

    def __init__(self, samples: dict, batch_size: int, seed: int):
        self.samples, self.batch_size, self.seed = samples, batch_size, seed
        self.count = len(next(iter(samples.values())))

    @classmethod
    def for_task(cls, task: str, ctx, cfg: DistillConfig) -> "Batches":
        import torch

        texts = ctx.calibration().items
        if task == "causal_lm":
            from optimize.evaluate.generation import Tokens

            ids = Tokens(ctx)("\n\n".join(texts))
            windows = len(ids) // cfg.seq_len
            if windows < 1:
                raise RecipeError(f"the calibration text has {len(ids)} tokens, fewer than distill.params.seq_len")
            samples = {"input_ids": torch.tensor(ids[: windows * cfg.seq_len]).reshape(windows, cfg.seq_len)}
        else:
            samples = {k: torch.as_tensor(v)[:, : cfg.seq_len] for k, v in ctx.encode(texts).items()}
        return cls(samples, cfg.batch_size, cfg.seed)

    def rows(self, step: int):
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randperm(self.count, generator=generator)[: self.batch_size]

    def batch(self, step: int) -> dict:
        """The step's samples; `rows` (their indices) lets an objective look up cached teacher outputs."""
        rows = self.rows(step)
        return {"rows": rows, **{k: v[rows] for k, v in self.samples.items()}}


# ---------------------------------------------------------------- losses


class Objective:
    """loss(batch) -> (total, parts) for the task's outputs plus hidden states."""

    def __init__(self, teacher, student, layer_map, cfg: DistillConfig):
        self.teacher, self.student, self.layer_map, self.cfg = teacher, student, layer_map, cfg

    @staticmethod
    def for_task(task, teacher, student, layer_map, cfg, ctx) -> "Objective":
        if task == "causal_lm":
            return LogitObjective(teacher, student, layer_map, cfg)
        return EmbeddingObjective(teacher, student, layer_map, cfg, ctx)

    def matched_layers(self) -> list[tuple[int, int]]:
        """(student layer, teacher layer) pairs the hidden loss compares."""
        pairs = list(enumerate(self.layer_map))
        return pairs[-1:] if self.cfg.hidden_layers == "last" else pairs

    def hidden_loss(self, student_hidden, teacher_hidden, mask):
        """Mean over matched layers of MSE(student j, teacher layer_map[j]) / mean(teacher^2)."""
        losses = []
        weights = mask.unsqueeze(-1).float()
        for j, t in self.matched_layers():
            s_h, t_h = student_hidden[j + 1], teacher_hidden[t + 1]  # index 0 is the embedding output
            scale = (t_h.pow(2) * weights).sum() / weights.sum() / t_h.shape[-1]
            losses.append(((s_h - t_h).pow(2) * weights).sum() / weights.sum() / t_h.shape[-1] / scale.clamp(min=1e-8))
        return sum(losses) / len(losses)

    def combine(self, output, hidden):
        total = self.cfg.output_weight * output + self.cfg.hidden_weight * hidden
        return total, {"output": float(output.detach()), "hidden": float(hidden.detach())}

    def before_training(self, student, ctx) -> dict:
        return {}

    def prepare(self, batches: "Batches") -> None:
        """Work done once before training (nothing by default)."""


class EmbeddingObjective(Objective):
    """Sentence encoders: every sample is a fixed-length row of the calibration set, so the frozen
    teacher's outputs for it do not depend on the batch it lands in. They are computed once
    (the mapped layers and the pooled embedding), which removes the teacher's forward pass (~40%
    of a step) from every step."""

    def __init__(self, teacher, student, layer_map, cfg, ctx):
        super().__init__(teacher, student, layer_map, cfg)
        self.pooling = ctx.pooling

    def prepare(self, batches: "Batches") -> None:
        import torch

        kept = [t + 1 for _, t in self.matched_layers()]  # hidden_states index 0 is the embedding output
        hidden: dict[int, list] = {i: [] for i in kept}
        embeddings: list = []
        count, size = batches.count, batches.batch_size
        with torch.no_grad():  # (not inference_mode: the cosine loss saves the teacher side for backward)
            for start in range(0, count, size):
                chunk = {k: v[start : start + size] for k, v in batches.samples.items()}
                out = self.teacher(**chunk, output_hidden_states=True)
                embeddings.append(_pool(out.last_hidden_state, chunk["attention_mask"], self.pooling))
                for i in kept:
                    hidden[i].append(out.hidden_states[i])
        # Hidden states kept in float16 (relative error ~5e-4, far below what the student reaches):
        # 2048 samples of 96 tokens for MiniLM's 3 mapped layers are 450 MB instead of 900.
        self.cached = {
            "embedding": torch.cat(embeddings),
            "hidden": {i: torch.cat(h).to(torch.float16) for i, h in hidden.items()},
        }

    def loss(self, batch):
        import torch

        rows = batch.pop("rows")
        mask = batch["attention_mask"]
        t_emb = self.cached["embedding"][rows]
        t_hidden = {i: h[rows].float() for i, h in self.cached["hidden"].items()}
        s_out = self.student(**batch, output_hidden_states=True)
        s_emb = _pool(s_out.last_hidden_state, mask, self.pooling)
        output = 1 - torch.nn.functional.cosine_similarity(s_emb, t_emb, dim=-1).mean()
        return self.combine(output, self.hidden_loss(s_out.hidden_states, t_hidden, mask))


def _pool(hidden, mask, pooling: dict):
    """The task's pooling (mean over real tokens, or CLS; normalized if the model says so), with gradients."""
    import torch

    if pooling["mode"] == "cls":
        pooled = hidden[:, 0]
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1) if pooling["normalize"] else pooled


class LogitObjective(Objective):
    def loss(self, batch):
        import torch
        import torch.nn.functional as F

        ids = batch["input_ids"]  # (the vocabulary-wide teacher logits are too large to cache)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            t_out = self.teacher(input_ids=ids, output_hidden_states=True, use_cache=False)
        s_out = self.student(input_ids=ids, output_hidden_states=True, use_cache=False)
        temp = self.cfg.temperature
        vocab = s_out.logits.shape[-1]
        # KL(teacher || student) per token, averaged over tokens; T^2 restores the gradient scale.
        kl = (
            F.kl_div(
                F.log_softmax(s_out.logits.float().reshape(-1, vocab) / temp, -1),
                F.log_softmax(t_out.logits.float().reshape(-1, vocab) / temp, -1),
                log_target=True,
                reduction="batchmean",
            )
            * temp**2
        )
        return self.combine(kl, self.hidden_loss(s_out.hidden_states, t_out.hidden_states, mask))

    def before_training(self, student, ctx) -> dict:
        """Held-out perplexity of the pruned-only student (the middle column of the report), scored
        on the same tokens the evaluation uses; a hook adds the row and the recovery figure."""
        from engines.pytorch_runner import TorchLM
        from optimize.evaluate.generation import Tokens, perplexity
        from optimize.tasks.causal_lm import eval_config

        cfg = eval_config(ctx)
        tokens = Tokens(ctx)
        ids = tokens("\n\n".join(ctx.evaluation_data().items))[: cfg.perplexity_tokens]
        pruned = perplexity(TorchLM(student), ids, cfg.perplexity_window)
        ctx.metric_hooks.append(lambda metrics: add_recovery(metrics, pruned))
        log.info("pruned-only perplexity before distillation: %.3f", pruned)
        return {"pruned_only_perplexity": pruned}


def add_recovery(metrics: dict, pruned: float) -> None:
    """Share of the perplexity lost to pruning that distillation won back:
    (ppl_pruned - ppl_distilled) / (ppl_pruned - ppl_original)."""
    base, cand = metrics["baseline"].get("perplexity"), metrics["candidate"].get("perplexity")
    if base is None or cand is None:
        return
    lost = pruned - base
    recovery = (pruned - cand) / lost if lost > 0 else 1.0
    metrics["candidate"]["pruned_only_perplexity"] = pruned
    metrics["candidate"]["distill_recovery"] = recovery
    metrics.setdefault("table", []).insert(
        1,
        [
            "perplexity: original / pruned-only / pruned+distilled",
            f"{base:.3f}",
            f"{pruned:.3f} / {cand:.3f}",
            f"recovered {recovery * 100:.0f}% of the pruning loss",
        ],
    )


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
    from omegaconf import OmegaConf

    from optimize.models import cache_root, source_hash

    config = {k: v for k, v in asdict(cfg).items() if k not in RUN_BOUNDS}
    identity = {
        "source": source_hash(ctx.source) or ctx.source.location,
        "prune": OmegaConf.to_container(ctx.cfg.prune, resolve=True),
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
