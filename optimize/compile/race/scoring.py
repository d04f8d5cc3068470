"""Scoring encoder candidates: fidelity to the baseline on the evaluation data, then one
block-alternating timing run per batch size with the baseline and every candidate taking turns, within
the race's timing budget."""

from __future__ import annotations

from optimize.compile.race.budget import TimingBudget
from optimize.compile.race.build import ProgressLine
from optimize.compile.race.candidates import EngineRaceConfig
from optimize.compile.race.entry import Entry


def score(entries: list[Entry], ctx, workload, cfg: EngineRaceConfig) -> tuple[dict, dict]:
    """Fidelity of every candidate against the baseline on the evaluation data, then one timing run
    per batch size (evaluate.batch_sizes and every workload point) with the baseline and every
    candidate taking turns, timed again while the machine was busy and the timing budget allows.
    Returns the baseline's p50s and the timing phase's record (budget.TimingBudget)."""
    from engines import engine_bytes, load_engine
    from optimize import tasks
    from optimize.evaluate import benchmark, harness

    task = tasks.get(entries[0].model.task)
    baseline = ctx.baseline.runner
    runners = {}
    for entry in entries:
        runner = load_engine(entry.model.engine_dir, entry.model.engine, threads=ctx.threads)
        runners[entry.name] = runner
        entry.size_mb = engine_bytes(entry.model.engine_dir, entry.model.engine) / 2**20
    inputs, _ = harness.evaluation_inputs(ctx, next(iter(runners.values())))
    batches = harness.batches_of(inputs, harness.FIDELITY_BATCH)
    reference = harness.run_all(baseline, batches)
    for entry in entries:
        outputs = harness.run_all(runners[entry.name], batches)
        entry.fidelity = harness.fidelity_of(reference, outputs, task.fidelity_output, ctx.plan.evaluate.top_k)
        entry.scores = task.race_scores(reference, outputs, ctx)  # classifiers: labeled accuracy
    clock = TimingBudget(cfg, entries)
    line = ProgressLine()
    points = workload.batch_sizes_timed(list(ctx.plan.evaluate.batch_sizes))
    baseline_p50 = {}
    for number, batch_size in enumerate(points, 1):
        timed = [b for b in harness.batches_of(inputs, batch_size) if harness.sample_count(b) == batch_size]
        runs = {"baseline": baseline, **runners}
        measure_s = clock.measure_s(len(points) - number + 1, len(runs))
        # Past the budget (a busy machine), the fewest calls that still give a median: 1 + 3 a runner.
        warmup, fewest = (2, 5) if measure_s > 0 else (1, 3)
        head = f"race: timing batch {batch_size} ({number}/{len(points)})"
        line.show(f"{head}: {clock.spent_s():.0f} s of {clock.total_s:.0f} s")
        stats = benchmark.quietest(
            lambda: benchmark.measure(
                runs,  # noqa: B023
                timed,  # noqa: B023
                batch_size,  # noqa: B023
                warmup=warmup,  # noqa: B023
                repeats=cfg.timing_repeats,
                budget_s=measure_s,  # noqa: B023
                min_repeats=fewest,  # noqa: B023
            ),
            ctx.plan.evaluate.retimes,
            until=clock.end(),
        )
        if stats.get("retime_cut"):
            clock.cut_points.append(str(batch_size))
        baseline_p50[str(batch_size)] = stats["baseline"]["p50_ms"]
        for entry in entries:
            entry.latency[str(batch_size)] = {
                "p50_ms": stats[entry.name]["p50_ms"],
                "x_baseline": stats["baseline"]["p50_ms"] / stats[entry.name]["p50_ms"],
                "other_cpu_share": stats["other_cpu_share"],
                "retimes": stats["retimes"],
            }
    line.close()
    clock.finish()
    return baseline_p50, clock.record()
