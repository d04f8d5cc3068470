"""Multiruns (`python -m optimize -m ...`): every job's exit code, and the sweep's, on any launcher.

A single run exits with its own code. In a multirun each job returns its code instead (an exit
inside the first job would end the sweep there), and writes it to `SWEEP_DIR/jobs/NUM.json`: the
launcher may run jobs in other processes (joblib), as SLURM jobs (submitit) or on a Ray cluster, so
the sweep directory, which every job shares, is the one place they can all report to. When the
launcher returns, `SweepSummary` (a Hydra callback, in the process that started the sweep) prints one
line per job and sets the sweep's exit code: the worst of its jobs' (an internal error or a job that
left no record, then an interrupt, then a bad input, then a failed gate, then passed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hydra.experimental.callback import Callback

from optimize import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL_ERROR, EXIT_PASSED, EXIT_SIGINT, EXIT_SIGTERM

JOBS = "jobs"
# From best to worst: the sweep exits with the worst code any job had.
SEVERITY = (EXIT_PASSED, EXIT_GATE_FAILED, EXIT_BAD_INPUT, EXIT_SIGINT, EXIT_SIGTERM, EXIT_INTERNAL_ERROR)
MEANING = {
    EXIT_PASSED: "gate passed",
    EXIT_GATE_FAILED: "gate failed",
    EXIT_BAD_INPUT: "bad input, nothing written",
    EXIT_SIGINT: "interrupted",
    EXIT_SIGTERM: "stopped (SIGTERM)",
    EXIT_INTERNAL_ERROR: "internal error",
}
# The exit code of the last multirun in this process (None: no multirun finished).
result: dict[str, int | None] = {"exit_code": None}


def record_job(code: int, hydra_cfg, artifact: Path | None) -> None:
    """Write this job's exit code where the process that started the sweep reads it."""
    folder = Path(hydra_cfg.sweep.dir) / JOBS
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "num": int(hydra_cfg.job.num),
        "overrides": list(hydra_cfg.overrides.task),
        "exit_code": code,
        "artifact": str(artifact) if artifact is not None else None,
    }
    tmp = folder / f".{record['num']}.json.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, folder / f"{record['num']}.json")


def expected_jobs(task_overrides: list[str]) -> int:
    """How many jobs Hydra's basic sweeper makes of these overrides (the product of the swept lists)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(task_overrides)
    return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))


def summarize(sweep_dir: Path, expected: int) -> tuple[int, list[str]]:
    """The sweep's exit code and one line per job (with the overrides that set it apart); a job that
    left no record (killed, or its node lost) counts as an internal error."""
    written = [int(p.stem) for p in (sweep_dir / JOBS).glob("*.json") if p.stem.isdigit()]
    # A sweeper plugin that chooses its own jobs (Optuna, Nevergrad) may run more than the lists say.
    numbers = range(max([expected, *(n + 1 for n in written)]))
    records: dict[int, dict] = {}
    for num in numbers:
        try:
            record = json.loads((sweep_dir / JOBS / f"{num}.json").read_text())
            record["exit_code"] = int(record["exit_code"])
            records[num] = record
        except (OSError, ValueError, KeyError, TypeError):
            pass
    shared = set.intersection(*(set(r.get("overrides") or []) for r in records.values())) if records else set()
    lines, codes = [], []
    for num in numbers:
        if num not in records:
            codes.append(EXIT_INTERNAL_ERROR)
            lines.append(f"job {num}: no exit code recorded (the job died, or could not write to {sweep_dir / JOBS})")
            continue
        record, code = records[num], records[num]["exit_code"]
        codes.append(code)
        own = " ".join(o for o in record.get("overrides") or [] if o not in shared) or "(as the others)"
        where = f": {record['artifact']}" if record.get("artifact") else ""
        lines.append(f"job {num} [{own}]: exit {code} ({MEANING.get(code, 'unknown')}){where}")
    return worst(codes), lines


def worst(codes: list[int]) -> int:
    def rank(code: int) -> int:
        return SEVERITY.index(code) if code in SEVERITY else len(SEVERITY)

    return max(codes, key=rank, default=EXIT_PASSED)


class SweepSummary(Callback):
    """Registered in recipes/config.yaml (hydra.callbacks); acts at the end of a multirun only."""

    def on_multirun_start(self, config, **kwargs) -> None:
        # A sweep directory used again (a fixed hydra.sweep.dir) must not report an earlier sweep's jobs.
        shutil.rmtree(Path(config.hydra.sweep.dir) / JOBS, ignore_errors=True)

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        code, lines = summarize(sweep_dir, expected_jobs(list(config.hydra.overrides.task)))
        print(f"sweep: {sweep_dir} ({len(lines)} jobs)")
        for line in lines:
            print(f"  {line}")
        print(f"sweep: exit {code} (the worst job's: {MEANING.get(code, 'unknown')})")
        result["exit_code"] = code
