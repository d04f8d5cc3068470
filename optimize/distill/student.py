"""The student and its layer map: the prune stage's module, or evenly spaced teacher layers."""

from __future__ import annotations

from optimize.distill.config import DistillConfig
from optimize.errors import RecipeError


def make_student(module, teacher, cfg: DistillConfig, ctx, kept_layers: list[int] | None = None):
    """(student, layer map). The prune stage's module is the student; without one, build it from
    `student_layers` evenly spaced teacher layers (a student larger than the teacher is an error)."""
    from optimize.transforms.surgery import Layout, evenly_spaced, keep_layers, student_copy

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
