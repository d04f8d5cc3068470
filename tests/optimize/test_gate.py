from optimize.gate import gate_keys, judge

BASE = {"size_mb": 90.0, "latency": {"1": {"p50_ms": 20.0, "p95_ms": 25.0}}}
CAND = {
    "size_mb": 30.0,
    "fidelity": {"cosine_min": 0.991, "cosine_mean": 0.998, "topk_agreement": 0.9},
    "latency": {"1": {"p50_ms": 10.0, "p95_ms": 12.0}, "32": {"p50_ms": 100.0, "p95_ms": 150.0}},
    "speedup": {"1": 2.0, "32": 1.1},
}


def by_name(verdict):
    return {c.name: c for c in verdict.checks}


def test_all_checks_pass():
    verdict = judge(BASE, CAND, {"min_cosine": 0.99, "min_speedup": 1.5, "max_size_mb": 40})
    assert verdict.passed
    assert [c.name for c in verdict.checks] == ["min_cosine", "min_speedup", "max_size_mb"]
    assert by_name(verdict)["min_speedup"].value == 2.0


def test_one_failed_check_fails_the_verdict_and_is_reported_with_value_and_threshold():
    verdict = judge(BASE, CAND, {"min_cosine": 0.995, "min_speedup": 1.5})
    assert not verdict.passed
    failed = by_name(verdict)["min_cosine"]
    assert (failed.passed, failed.value, failed.threshold, failed.comparison) == (False, 0.991, 0.995, ">=")
    assert by_name(verdict)["min_speedup"].passed


def test_unset_thresholds_are_not_checked():
    verdict = judge(BASE, CAND, {"min_cosine": None, "max_size_mb": 40, "max_p95_ms": None})
    assert [c.name for c in verdict.checks] == ["max_size_mb"]


def test_a_threshold_on_an_unmeasured_metric_fails():
    verdict = judge(BASE, {"size_mb": 30.0}, {"min_speedup": 1.5, "max_peak_memory_mb": 500})
    assert not verdict.passed
    assert all(c.note == "not measured" and c.value is None for c in verdict.checks)


def test_batch_size_selects_the_latency_and_speedup_checked():
    verdict = judge(
        BASE, CAND, {"min_speedup": 1.5, "speedup_batch_size": 32, "max_p95_ms": 140, "latency_batch_size": 32}
    )
    checks = by_name(verdict)
    assert checks["min_speedup"].value == 1.1 and not checks["min_speedup"].passed
    assert checks["max_p95_ms"].value == 150.0 and not checks["max_p95_ms"].passed
    assert "batch 32" in checks["min_speedup"].metric


def test_boundaries_are_inclusive():
    verdict = judge(BASE, CAND, {"min_cosine": 0.991, "max_size_mb": 30.0})
    assert verdict.passed


def test_verdict_serializes_every_check():
    data = judge(BASE, CAND, {"min_cosine": 0.99}).to_dict()
    assert data["passed"] is True
    assert data["checks"][0] == {
        "name": "min_cosine",
        "metric": "fidelity cosine (min)",
        "value": 0.991,
        "comparison": ">=",
        "threshold": 0.99,
        "passed": True,
        "note": "",
    }


def test_every_gate_threshold_in_the_schema_has_a_check():
    from dataclasses import fields

    from optimize.config import GateConfig
    from optimize.tasks.lm_served import SERVED_SETTINGS

    selectors = {"speedup_batch_size", "latency_batch_size", "request_shape", *SERVED_SETTINGS}
    assert {f.name for f in fields(GateConfig)} - selectors == gate_keys()


def test_latency_checks_timed_on_a_busy_machine_fail_with_a_note():
    busy = dict(CAND, timing={"other_cpu_share": 0.6})
    verdict = judge(BASE, busy, {"min_cosine": 0.99, "min_speedup": 1.5, "max_p95_ms": 100})
    checks = by_name(verdict)
    assert not verdict.passed and checks["min_cosine"].passed
    for name in ("min_speedup", "max_p95_ms"):
        assert not checks[name].passed and "other processes used 60% of the CPUs" in checks[name].note
    quiet = judge(BASE, dict(CAND, timing={"other_cpu_share": 0.05}), {"min_speedup": 1.5})
    assert quiet.passed


def test_other_cpu_use_sees_a_busy_process():
    """A process spinning on one core for the whole block is other processes' CPU time."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from optimize.evaluate.benchmark import OtherCpuUse

    # Started through a shell that exits at once, so the spinner is not this process's child (the
    # CPU time of children, such as timing workers, counts as the run's own).
    spin = "import time\nt = time.time()\nwhile time.time() - t < 5: pass"
    shell = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{spin}" >/dev/null 2>&1 & echo $!'], capture_output=True, text=True
    )
    spinner = int(shell.stdout.strip())
    try:
        time.sleep(0.5)
        with OtherCpuUse() as others:
            time.sleep(1.5)
    finally:
        os.kill(spinner, signal.SIGKILL)
    assert others.share >= 0.6 / (os.cpu_count() or 1)
