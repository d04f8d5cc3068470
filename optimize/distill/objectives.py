"""The distillation losses: the task's output (next-token KL for causal LMs, pooled-embedding
cosine for sentence encoders, class-logit KL for classifiers) plus hidden states matched layer to
layer."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from optimize.context import Context
from optimize.distill.config import DistillConfig
from optimize.distill.data import Batches
from optimize.errors import RecipeError
from optimize.tasks.base import Task

log = logging.getLogger(__name__)


class Objective:
    """loss(batch) -> (total, parts) for the task's outputs plus hidden states."""

    def __init__(self, teacher, student, layer_map, cfg: DistillConfig):
        self.teacher, self.student, self.layer_map, self.cfg = teacher, student, layer_map, cfg

    @staticmethod
    def for_task(task: Task, teacher, student, layer_map, cfg: DistillConfig, ctx: Context) -> "Objective":
        """The objective for what the task's output is (Task.distill_loss)."""
        if task.distill_loss == "logits":
            return LogitObjective(teacher, student, layer_map, cfg)
        if task.distill_loss == "embedding":
            return EmbeddingObjective(teacher, student, layer_map, cfg, ctx)
        if task.distill_loss == "class_logits":
            return ClassLogitObjective(teacher, student, layer_map, cfg)
        raise RecipeError(f"distill does not support model.task={task.name}")

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

    def metric_hook(self, before: dict) -> Callable[[dict], None] | None:
        """What this objective adds to the evaluation's metrics, given before_training's figures."""
        return None

    def prepare(self, batches: Batches) -> None:
        """Work done once before training (nothing by default)."""


class EmbeddingObjective(Objective):
    """Sentence encoders: every sample is a fixed-length row of the calibration set, so the frozen
    teacher's outputs for it do not depend on the batch it lands in. They are computed once
    (the mapped layers and the pooled embedding), which removes the teacher's forward pass (~40%
    of a step) from every step."""

    def __init__(self, teacher, student, layer_map, cfg, ctx):
        super().__init__(teacher, student, layer_map, cfg)
        self.pooling = ctx.pooling

    def prepare(self, batches: Batches) -> None:
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
        self.cached: dict[str, Any] = {
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
        from engines.pytorch.runner import TorchLM
        from optimize.evaluate.generation import Tokens, perplexity
        from optimize.tasks.causal_lm import eval_config

        cfg = eval_config(ctx)
        tokens = Tokens(ctx)
        ids = tokens("\n\n".join(ctx.evaluation_data().items))[: cfg.perplexity_tokens]
        pruned = perplexity(TorchLM(student), ids, cfg.perplexity_window)
        log.info("pruned-only perplexity before distillation: %.3f", pruned)
        return {"pruned_only_perplexity": pruned}

    def metric_hook(self, before: dict) -> Callable[[dict], None]:
        """Adds the pruned-only perplexity row and the recovery figure."""
        return functools.partial(add_recovery, pruned=before["pruned_only_perplexity"])


class ClassLogitObjective(Objective):
    """Classifiers (a label per text, or per token): KL between the teacher's and the student's class
    distributions at temperature T, over real tokens for a token classifier, plus hidden states.
    The class logits are small, so the teacher runs beside the student rather than being cached."""

    def loss(self, batch):
        import torch
        import torch.nn.functional as F

        batch.pop("rows")
        mask = batch["attention_mask"]
        with torch.no_grad():
            t_out = self.teacher(**batch, output_hidden_states=True)
        s_out = self.student(**batch, output_hidden_states=True)
        temp = self.cfg.temperature
        s_logits, t_logits = s_out.logits.float(), t_out.logits.float()
        classes = s_logits.shape[-1]
        if s_logits.dim() == 3:  # per token: only real tokens count
            keep = mask.reshape(-1).bool()
            s_logits, t_logits = s_logits.reshape(-1, classes)[keep], t_logits.reshape(-1, classes)[keep]
        student_log_p, teacher_log_p = F.log_softmax(s_logits / temp, -1), F.log_softmax(t_logits / temp, -1)
        kl = F.kl_div(student_log_p, teacher_log_p, log_target=True, reduction="batchmean") * temp**2
        return self.combine(kl, self.hidden_loss(s_out.hidden_states, t_out.hidden_states, mask))


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
