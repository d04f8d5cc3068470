"""Training batches: the task's samples of the calibration text, drawn deterministically per step."""

from __future__ import annotations

from optimize.context import Context
from optimize.distill.config import DistillConfig
from optimize.tasks.base import Task


class Batches:
    """batch(step) -> dict of int64 tensors; deterministic in the step, so a resumed run sees the
    same data it would have seen without the interruption."""

    def __init__(self, samples: dict, batch_size: int, seed: int):
        self.samples, self.batch_size, self.seed = samples, batch_size, seed
        self.count = len(next(iter(samples.values())))

    @classmethod
    def for_task(cls, task: Task, ctx: Context, cfg: DistillConfig) -> "Batches":
        """The task's training samples of the calibration text (Task.training_samples)."""
        return cls(task.training_samples(ctx, ctx.calibration().items, cfg.seq_len), cfg.batch_size, cfg.seed)

    def rows(self, step: int):
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randperm(self.count, generator=generator)[: self.batch_size]

    def batch(self, step: int) -> dict:
        """The step's samples; `rows` (their indices) lets an objective look up cached teacher outputs."""
        rows = self.rows(step)
        return {"rows": rows, **{k: v[rows] for k, v in self.samples.items()}}
