"""Engine: the race (optimize/compile/race/). Build the candidates that make sense for the model and
this machine, measure each with the same harness, and ship the fastest that passes every accuracy
check of the gate."""

from __future__ import annotations

import time

from optimize import cache_store
from optimize import stages as memory_stages
from optimize.compile.race import budget as budgets
from optimize.compile.race import lm, report, scoring
from optimize.compile.race.build import build_all, export_once
from optimize.compile.race.candidates import EngineRaceConfig, default_candidates
from optimize.compile.race.choice import choose, untimed_thresholds
from optimize.compile.race.entry import Entry
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register


def race_formats(cfg: EngineRaceConfig, task) -> tuple[str, ...]:
    """The engine formats the race's candidates build for `task` (each once, in candidate order)."""
    from optimize import registry

    names = cfg.candidates or default_candidates(task.generates)
    found = [f for name in names for f in registry.get("engine", cfg.spec(name).engine).formats(None, task)]
    return tuple(dict.fromkeys(found))


@register(
    "engine",
    "auto",
    EngineRaceConfig,
    needs_calibration=True,
    input_format="torch",
    builds_candidates=True,
    engine_formats=race_formats,
)
def engine_race(model: Model, cfg: EngineRaceConfig, ctx: Context) -> Model:
    """Race ONNX Runtime and OpenVINO candidates on this machine; ship the fastest over the recipe's
    workload that passes accuracy."""
    from optimize import tasks

    started = time.monotonic()
    workload = ctx.plan.workload
    thresholds = untimed_thresholds(dict(ctx.plan.gate))
    lm_race = tasks.get(model.task).generates
    exported, export = (model, None) if lm_race else export_once(model, ctx)  # decoders: built from the module
    gguf = bool(ctx.source is not None and ctx.source.gguf_file)
    names, left_out = budgets.sized_candidates(cfg, model, lm_race, gguf)
    entries = [Entry(name, cfg.spec(name)) for name in names]
    if lm_race:
        budgets.refuse_at_plan_time(entries, model)
    if ctx.plan.serve.structured_output:
        budgets.refuse_unconstrained(entries, ctx.plan.task)
    budgets.refuse_for_memory(entries, model)
    key_base = cache_store.build_identity(model, ctx)
    budget = budgets.Budget(cfg, entries, model)  # its clock starts here, at the first build
    with memory_stages.stage("race: build"):
        build_all(entries, exported, ctx, key_base if cfg.cache else None, budget)
    built = [e for e in entries if e.model is not None]
    budgets.say_if_fewer(entries, built)
    if not built:
        raise RecipeError(
            "engine.method=auto: no candidate could be built here: "
            + "; ".join(f"{e.name}: {e.outcome}" for e in entries)
        )
    halving = timing = None
    if lm_race:
        with memory_stages.stage("race: scoring"):
            baseline = lm.score(built, ctx, workload, cfg, thresholds, key_base if cfg.cache else None)
        with memory_stages.stage("race: served timing"):  # each passing one as served, per level
            halving = lm.serve_passing(built, ctx, workload, thresholds, baseline)
        winner = lm.choose(built, workload, baseline, thresholds)
    else:
        with memory_stages.stage("race: scoring"):
            baseline, timing = scoring.score(built, ctx, workload, cfg)
        winner = choose(built, workload, baseline, thresholds)
    plot = report.plot_front(entries, workload, ctx.scratch / "race_front.png")
    record = report.race_record(ctx, workload, entries, winner, baseline, export, plot, time.monotonic() - started)
    record.update(budget=budget.record(entries), fewer_than_asked=budgets.fewer_than_asked(entries))
    record.update(left_out_for_size=left_out)
    if timing is not None:
        record.update(timing=timing)
    if halving is not None:
        record.update(served_halving=halving, served_cut_note=report.cut_note(halving))
    # The winner's engine record is in the race's (winner_engine); its quantize record is filed as its own.
    inner = {stage: info for stage, info in winner.records.items() if stage != "engine"}
    return winner.model.recorded(record, files={report.PLOT: plot} if plot else None, inner_records=inner)
