"""Every refusal known before a stage runs on a model that takes tensors, in one message."""

from __future__ import annotations

from pathlib import Path

from optimize.errors import RecipeError


def plan_time_refusals(ctx, stages, onnx_path: Path) -> None:
    """Before any stage runs on a model that takes tensors: every refusal already known (symbolic dims
    nothing sets, text data for tensor inputs, op_types that match none of the graph's weighted nodes),
    in one message, so a new user fixes them in one round instead of one per run."""
    encoder, evaluate = ctx.encoder, ctx.plan.evaluate
    # The race builds what it can: a candidate that cannot calibrate on this data is recorded as not
    # built (its outcome says why), so text calibration is refused here only for a stage that needs it.
    # A method's config may say it reads no calibration with these settings (uses_calibration()).
    needs_calibration = any(
        m.needs_calibration and not m.builds_candidates and getattr(c, "uses_calibration", lambda: True)()
        for m, c in stages
    )
    calibration = ctx.calibration() if needs_calibration else None
    random_data = evaluate.inputs == "random" or (calibration is not None and calibration.source == "random")
    problems: list[str] = []
    for plan in encoder.plans:
        if plan is encoder.data_input and not random_data:
            continue  # the data's items decide the data input's symbolic dims
        try:
            plan.shape(1)
        except RecipeError as exc:
            problems.append(str(exc))
    # the random source makes tensors from model.inputs (Context.calibration_inputs)
    data_sets = [("calibration.source", calibration)] if calibration and calibration.source != "random" else []
    if evaluate.inputs == "data":
        data_sets.append(("evaluate.data.source", ctx.evaluation_data()))
    for key, data in data_sets:
        try:
            ctx.refuse_text_for_tensors(data, key)
        except RecipeError as exc:
            problems.append(str(exc))
    for method, method_cfg in stages:
        refusal = method.refuses(method_cfg, onnx_path)
        if refusal:
            problems.append(refusal)
    if len(problems) == 1:
        raise RecipeError(problems[0])
    if problems:
        numbered = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        raise RecipeError(f"{len(problems)} things to fix before this recipe can run on this model: {numbered}")
