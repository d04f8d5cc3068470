"""The pipeline's command line as a user runs it, and the one check for its refusals (exit 2, one line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# A quick variant of the default recipe: fewer evaluation samples, no sensitivity search, no
# latency or memory runs. The gate still checks fidelity, so the artifact is a real passing one.
# ONNX Runtime dynamic INT8 without the race (the race has tests of its own): seconds, not minutes.
# Its verdict holds on every CPU kind: with the 7-bit weights of CPUs without VNNI and the 8-bit
# ones of VNNI CPUs, MiniLM measured min cosine 0.991 / 0.992, mean 0.993 / 0.995, top-k 0.96 / 0.96.
FAST_OVERRIDES = [
    "engine=onnx",
    "quantize=ort_int8_dynamic",
    "evaluate.data.count=16",
    "evaluate.latency=false",
    "evaluate.memory=false",
    "quantize.params.fallback_min_cosine=null",
    "gate.min_speedup=null",
    "gate.min_cosine=0.95",
    "gate.min_mean_cosine=0.98",
    "gate.min_topk_agreement=0.5",
    "calibration.count=16",
    # No speed is gated here, and the other test worker always shares the machine: a point timed while
    # it was busy would be timed twice more for nothing (benchmark.quietest).
    "evaluate.retimes=0",
]


# The LM race at the tiny counts the causal-LM tests use (a random Llama or a small GGUF file): a few
# evaluation texts and tokens, no lm-eval, no speed bar (a timed check is "untrusted" whenever another
# process shares the machine), a perplexity bar no random model fails. One request shape unless a
# test names its own.
TINY_LM_RACE = [
    "recipe=smollm2_int4_cpu",
    "model.max_length=128",
    "gate.max_ppl_increase_pct=1000",
    "gate.min_decode_speedup=null",
    "evaluate.data.count=8",
    "evaluate.warmup=1",
    "evaluate.repeats=2",
    "calibration.count=4",
    "evaluate.task_params.perplexity_tokens=256",
    "evaluate.task_params.perplexity_window=128",
    "evaluate.task_params.prompt_tokens=16",
    "evaluate.task_params.new_tokens=8",
    "evaluate.task_params.lm_eval_tasks=[]",
    # Fidelity on a few tokens, no standard tasks, and no bars on either: a random model's INT4 copy
    # is not what the recipe's fidelity thresholds are set for.
    "evaluate.task_params.fidelity_tokens=512",
    "evaluate.task_params.standard_tasks=[]",
    "gate.max_mean_kld=null",
    "gate.min_top1_agreement=null",
    "gate.max_task_drop_pts=null",
    "workload.requests=null",
    "evaluate.retimes=0",  # as in FAST_OVERRIDES
]


def run_optimize(
    *overrides: str, cwd: Path | None = None, timeout: int = 900, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m optimize ...` as a user runs it, in a subprocess (`env`: variables to add)."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "optimize", *overrides],
        cwd=cwd or ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refusal_in_process(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m optimize ARGV` up to its refusal, in this process: the check the command runs before
    Hydra runs or writes anything (optimize.__main__.precheck: the flags parsed, the recipe composed and
    planned), its stdout, stderr and exit code returned as run_optimize returns a finished command's.
    Seconds less than a subprocess, which starts Python, Hydra and torch for one line. `env`: variables
    set while it runs. A command line that passes the check would run its recipe: that fails here (a
    refusal the run itself makes needs the real command, run_optimize)."""
    import contextlib
    import io
    from unittest import mock

    from optimize.__main__ import precheck
    from optimize.config import register_schema

    register_schema()
    stdout, stderr = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            precheck(list(argv))
        except SystemExit as exc:
            return subprocess.CompletedProcess(["optimize", *argv], exc.code, stdout.getvalue(), stderr.getvalue())
    raise AssertionError(f"python -m optimize {' '.join(argv)} passed its check: it would run\n{stderr.getvalue()}")


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str, log_lines: bool = False) -> str:
    """A refusal as every command line here makes it (`python -m optimize`, `optimize.verify`,
    `python -m serve`): exit 2, stderr one line `error: ...` naming each fragment, no traceback.
    `log_lines=True` lets other lines through (a library logging a warning while it is imported, as
    torch's ONNX exporter does on the image models' path) as long as exactly one is an `error:` line.
    Returns the line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    lines = proc.stderr.strip().splitlines()
    if log_lines:
        lines = [line for line in lines if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in proc.stderr
    return lines[0]
