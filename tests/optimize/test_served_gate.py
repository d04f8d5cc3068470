"""The served-latency gate: the real server started on the candidate artifact, real streaming clients,
the checks judging what they measured (tiny random Llama, ONNX Runtime GenAI INT4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.optimize.test_causal_lm import TINY_OVERRIDES
from tests.support.cli import one_error_line, refusal_in_process, run_optimize
from tests.support.models import tiny_llama_folder


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llm") / "src")


def base_overrides(tiny_llm: Path, tmp_path: Path) -> list[str]:
    return [
        f"model.source={tiny_llm}",
        *TINY_OVERRIDES,
        "evaluate.task_params.lm_eval_tasks=[]",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]


def test_a_served_threshold_too_tight_fails_the_run_on_what_the_clients_measured(tiny_llm, tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        *base_overrides(tiny_llm, tmp_path),
        "gate.max_served_ttft_p95_ms=0.001",  # no server answers in a microsecond
        "gate.min_served_tokens_per_s=0.001",
        "gate.served_concurrency=4",
        "gate.served_output_tokens=6",
        f"output_dir={out}",
        env={"SERVE_API_KEY": "sk-from-the-shell"},  # the gate's own server does not inherit it
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    served = manifest["metrics"]["candidate"]["served"]
    assert served["clients"] == 4 and served["requests"] == 8 and served["failed"] == 0
    assert served["prompt_tokens"] == 16 and served["requested_tokens"] == 6  # the workload's prompt, the gate's output
    assert 0 < served["output_tokens"] <= 8 * 6
    assert served["ttft_p95_ms"] >= served["ttft_p50_ms"] > 0
    checks = {c["name"]: c for c in manifest["gate"]["checks"]}
    ttft = checks["max_served_ttft_p95_ms"]
    assert ttft["value"] == served["ttft_p95_ms"] and ttft["passed"] is False
    rate = checks["min_served_tokens_per_s"]
    assert rate["value"] == served["tokens_per_s"] > 0
    # Passes on its number unless other processes took the CPUs while the load ran (then: untrusted).
    assert rate["passed"] is (served["other_cpu_share"] <= 0.25)
    assert manifest["verdict"] == "failed"
    assert "served time to first token p95 ms" in proc.stdout
    # The final manifest replaced the draft the server read, and the artifact still verifies.
    from engines.artifact import verify

    assert verify(out, None, False) == []


def test_served_checks_are_refused_where_they_cannot_be_measured(tiny_llm, tmp_path):
    proc = refusal_in_process(
        "recipe=minilm_int8_cpu", "gate.max_served_ttft_p95_ms=500", f"output_dir={tmp_path / 'a'}"
    )
    one_error_line(proc, "gate.max_served_ttft_p95_ms", "causal LMs", "sentence_embedding")
    proc = refusal_in_process(
        *base_overrides(tiny_llm, tmp_path), "gate.min_served_tokens_per_s=5", "gate.served_concurrency=0",
        f"output_dir={tmp_path / 'b'}",
    )  # fmt: skip
    one_error_line(proc, "gate.served_concurrency=0", "at least 1")
    proc = refusal_in_process(
        *base_overrides(tiny_llm, tmp_path), "gate.min_served_tokens_per_s=5", "evaluate.latency=false",
        f"output_dir={tmp_path / 'c'}",
    )  # fmt: skip
    one_error_line(proc, "gate.min_served_tokens_per_s", "evaluate.latency=false")
    proc = refusal_in_process(
        *base_overrides(tiny_llm, tmp_path), "workload.concurrency=[1,0]", f"output_dir={tmp_path / 'd'}"
    )
    one_error_line(proc, "workload.concurrency=[1, 0]: 0 is not a whole number of at least 1")
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_a_failed_request_leaves_the_served_figures_unmeasured():
    from optimize.gate import judge

    served = {"failed": 1, "requests": 8, "ttft_p95_ms": 5.0, "tokens_per_s": 90.0, "other_cpu_share": 0.0}
    verdict = judge({}, {"served": served}, {"max_served_ttft_p95_ms": 100.0})
    (check,) = verdict.checks
    assert check.value is None and check.note == "not measured" and not verdict.passed
    busy = {**served, "failed": 0, "other_cpu_share": 0.4}
    (check,) = judge({}, {"served": busy, "timing": {"other_cpu_share": 0.0}}, {"max_served_ttft_p95_ms": 100.0}).checks
    assert check.passed is False and "untrusted" in check.note  # the load's own share, not the evaluation's


def test_a_structured_share_gates_on_every_constrained_reply_being_valid(tiny_llm, tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        *base_overrides(tiny_llm, tmp_path),
        "serve.structured_output=true",
        "gate.served_structured_share=0.5",
        "gate.served_concurrency=2",
        "gate.served_output_tokens=48",
        f"output_dir={out}",
    )
    manifest = json.loads((out / "manifest.json").read_text())
    served = manifest["metrics"]["candidate"]["served"]
    structured = served["structured"]
    assert served["failed"] == 0 and structured["share"] == 0.5 and structured["requests"] == 2, served
    checks = {c["name"]: c for c in manifest["gate"]["checks"]}
    check = checks["max_served_invalid_structured"]
    assert check["threshold"] == 0 and check["value"] == structured["invalid"] == 0, check
    assert check["passed"] is True and "served constrained replies invalid" in proc.stdout
    assert manifest["recipe"]["resolved"]["serve"]["structured_output"] is True


def test_the_served_gate_checks_every_declared_concurrency_level_on_its_own(tiny_llm, tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        *base_overrides(tiny_llm, tmp_path),
        "workload.concurrency=[1,3]",
        "gate.max_served_ttft_p95_ms=0.001",  # fails at every level: no server answers in a microsecond
        "gate.min_served_tokens_per_s=0.001",
        "gate.served_output_tokens=4",
        "gate.served_requests_per_client=1",
        f"output_dir={out}",
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    served = manifest["metrics"]["candidate"]["served"]
    assert set(served["levels"]) == {"1", "3"} and served["clients"] == 3
    assert [served["levels"][k]["requests"] for k in ("1", "3")] == [1, 3]
    checks = {c["name"]: c for c in manifest["gate"]["checks"]}
    for level in ("1", "3"):
        ttft = checks[f"max_served_ttft_p95_ms[concurrency={level}]"]
        assert ttft["value"] == served["levels"][level]["ttft_p95_ms"] and ttft["passed"] is False
        assert checks[f"min_served_tokens_per_s[concurrency={level}]"]["value"] > 0
    assert "max_served_ttft_p95_ms" not in checks  # one check per level, none for the run as a whole
    assert "max_served_ttft_p95_ms[concurrency=3]" in proc.stdout


def test_served_settings_that_can_never_work_are_refused_before_anything_is_built(tiny_llm, tmp_path):
    proc = refusal_in_process(
        *base_overrides(tiny_llm, tmp_path), "gate.min_served_tokens_per_s=5", "gate.served_output_tokens=600",
        f"output_dir={tmp_path / 'a'}",
    )  # fmt: skip
    one_error_line(proc, "gate.served_output_tokens=600", "at most 512")
    proc = run_optimize(
        *base_overrides(tiny_llm, tmp_path), "gate.min_served_tokens_per_s=5", "gate.served_prompt_tokens=400",
        "gate.served_output_tokens=200", f"output_dir={tmp_path / 'b'}",
    )  # fmt: skip
    one_error_line(proc, "400 + 200", "context of 512")
    assert not any((tmp_path / name).exists() for name in "ab")


@pytest.mark.parametrize("target", ["pid", "group"])
def test_sigint_during_the_served_gate_is_exit_130_with_nothing_written(tiny_llm, tmp_path, target):
    """Ctrl-C (to the whole process group, as a terminal sends it) or SIGINT to the pipeline alone,
    once the gate's server runs: exit 130, no artifact, the server stopped."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from tests.support.serve import ROOT, wait_until

    out = tmp_path / "artifact"
    overrides = [
        *base_overrides(tiny_llm, tmp_path),
        "gate.min_served_tokens_per_s=0.001",
        "gate.served_requests_per_client=100000",  # far more than the run lasts: it is interrupted
        "gate.served_output_tokens=8",
        f"output_dir={out}",
    ]
    # `python -m optimize` with Ctrl-C's handler in place even where this runner's SIGINT is ignored (a
    # child inherits that: bash starts background jobs so).
    with_sigint = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('optimize', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", with_sigint, *overrides],
        cwd=ROOT,
        env=dict(os.environ, HYDRA_FULL_ERROR="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pipeline = psutil.Process(proc.pid)

        def serving():
            servers = []
            for child in pipeline.children():  # the evaluation's own children come and go meanwhile
                with contextlib.suppress(psutil.Error):
                    if child.cmdline()[1:3] == ["-m", "serve"]:
                        servers.append(child)
            return servers

        (server,) = wait_until(serving, timeout=600, step=0.5)
        # Interrupted once the load runs: the server has answered (its port line and a request).
        wait_until(lambda: len(server.net_connections(kind="tcp")) > 1, timeout=300)
        if target == "pid":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout[-2000:] + stderr[-3000:]
    assert "interrupted: nothing was written" in stderr
    assert not out.exists() and not any(p.name.startswith(".artifact") for p in tmp_path.iterdir())
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE


def test_a_server_never_ready_fails_every_served_check_as_not_measured():
    from optimize.gate import judge
    from optimize.tasks.lm_served import ServedLoad, not_served, table_rows

    load = ServedLoad(levels=(2,), prompt_tokens=16, output_tokens=6, requests_per_client=2)
    served = {**not_served(load, 2, "serve exited with 2: error: --max-batch-size: must be > 0"), "prompt_tokens": 16}
    served.update(requested_tokens=6, other_cpu_share=0.0)
    assert served["failed"] == served["requests"] == 4 and "exited with 2" in served["errors"][0]
    verdict = judge({}, {"served": served}, {"min_served_tokens_per_s": 1.0, "max_served_ttft_p95_ms": 100.0})
    assert not verdict.passed and all(c.value is None and c.note == "not measured" for c in verdict.checks)
    assert "4 of 4 requests failed" in table_rows(served)[0][3]
