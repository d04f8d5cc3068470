"""The distill stage's parameters (distill.params), checked before any weights load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from optimize.errors import RecipeError

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
