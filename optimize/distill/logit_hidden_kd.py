"""logit_hidden_kd: knowledge distillation from the source model, the task's output (logit KL or
embedding cosine) plus hidden states (see the package's docstring)."""

from __future__ import annotations

import dataclasses

from optimize import tasks
from optimize.context import Context, Model
from optimize.distill.config import DistillConfig
from optimize.distill.data import Batches
from optimize.distill.objectives import Objective
from optimize.distill.student import make_student
from optimize.distill.training import checkpoint_dir, loss_summary, plot_losses, train
from optimize.errors import RecipeError
from optimize.registry import register


@register(
    "distill",
    "logit_hidden_kd",
    DistillConfig,
    input_format="torch",
    needs_calibration=True,
    tasks=("sentence_embedding", "causal_lm", "text_classification", "token_classification"),
)
def logit_hidden_kd(model: Model, cfg: DistillConfig, ctx: Context) -> Model:
    """Knowledge distillation from the source model: the task's output (logit KL, embedding cosine or
    class-logit KL) plus hidden states."""
    import torch

    if model.kind != "torch":
        raise RecipeError("distill.method=logit_hidden_kd needs a PyTorch model (not an ONNX source)")
    assert ctx.source is not None  # the pipeline loads the source before any stage runs
    torch.manual_seed(cfg.seed)
    teacher = ctx.source.module.eval()
    student, layer_map = make_student(model.module, teacher, cfg, ctx, model.kept_layers)
    task = tasks.get(model.task)
    objective = Objective.for_task(task, teacher, student, layer_map, cfg, ctx)
    batches = Batches.for_task(task, ctx, cfg)
    before = objective.before_training(student, ctx)
    objective.prepare(batches)
    run = train(student, objective, batches, cfg, checkpoint_dir(ctx, cfg))
    loss_curve = plot_losses(run["losses"], ctx.scratch / "distill_loss.png")
    info = {
        "method": "logit_hidden_kd",
        "layer_map": layer_map,
        **before,
        **{k: v for k, v in run.items() if k != "losses"},
        "loss_curve": "distill/loss_curve.png",
        "loss_curve_summary": loss_summary(run["losses"]),
    }
    return dataclasses.replace(model, module=student.eval()).recorded(
        info, files={"distill/loss_curve.png": loss_curve}, metric_hook=objective.metric_hook(before)
    )
