"""Shared fixtures. The real pipeline builds one small MiniLM artifact per test session; tests that
need an artifact reuse it instead of rebuilding (export alone takes ~20 s on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import FAST_OVERRIDES, run_optimize
from tests.support.schedule import heaviest_files_first
from tests.support.shared import build_once, process_of, process_record

# Two test workers share two cores, and each runs torch (and the pipeline's children) with a thread per
# core: an OpenMP pool that spins while it waits for work takes the other worker's core. Sleeping
# instead (the commands and servers the tests start inherit it) measured 324 s against 373 s for
# test_pipeline_e2e.py beside test_causal_lm_smollm2.py. It must be set before torch is first imported
# (its OpenMP runtime reads it once): nothing imported above imports torch.
assert "torch" not in sys.modules, "tests/conftest.py: torch was imported before OMP_WAIT_POLICY was set"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_to_own_cores() -> None:
    """An xdist worker keeps to its share of the cores (worker i of n: every n-th core from the i-th),
    which the commands and servers it starts inherit and by which every runtime here sizes its thread
    pools (engines/hardware.usable_cores, torch, OpenVINO). Two workers running a thread per core each
    on two cores made each parallel region wait for a thread the other worker had descheduled: two
    runs of one tiny LM race side by side took 37 s each pinned, 41 s not (2-core Zen 4). Set before
    torch is first imported, as above."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit() and hasattr(os, "sched_setaffinity")):
        return
    cores = sorted(os.sched_getaffinity(0))
    if int(count) < 2 or len(cores) < int(count):
        return
    os.sched_setaffinity(0, cores[int(worker[2:]) :: int(count)])


keep_to_own_cores()

# The fast tier (`make test-fast`: pytest -m "not slow") is the unit tests. Slow are the tests that run
# the command line (`python -m optimize` starts Python, Hydra and torch, even for a refusal), build an
# artifact or an engine, load a model or serve one. They are marked here by module (modules of
# end-to-end tests) and by the fixtures that build artifacts (a test that takes one, directly or through
# another fixture); a slow test elsewhere says so itself with @pytest.mark.slow.
SLOW_DIRS = ("benchmarks",)
SLOW_MODULES = {
    "test_openvino_genai.py",
    "test_artifact_identity.py",
    "test_bad_inputs.py",
    "test_byom_e2e.py",
    "test_byom_failures.py",
    "test_causal_lm.py",
    "test_causal_lm_smollm2.py",
    "test_ci_report.py",
    "test_classifier_e2e.py",
    "test_cli.py",
    "test_cli_fuzz.py",
    "test_compare.py",
    "test_entrypoint_fuzz_bundle.py",
    "test_entrypoint_fuzz_publish.py",
    "test_export.py",
    "test_export_rtx.py",
    "test_export_vllm.py",
    "test_foreign_onnx.py",
    "test_image_classification.py",
    "test_lm_architectures.py",
    "test_packaging.py",
    "test_pipeline_e2e.py",
    "test_publish.py",
    "test_served_gate.py",
    "test_sweep.py",
    "test_tensorrt_rtx_pipeline.py",
    "test_serve_bench.py",
    "test_serve_classifier.py",
    "test_serve_cli.py",
    "test_serve_encoder.py",
    "test_serve_hostile.py",
    "test_serve_imports.py",
    "test_serve_llm.py",
    "test_serve_llm_batching.py",
    "test_serve_llm_batching_ort.py",
    "test_serve_llm_load.py",
    "test_serve_openvino.py",
    "test_serve_schema.py",
    "test_serve_subprocess.py",
}
SLOW_FIXTURES = {
    "minilm_run",
    "minilm_default_race",
    "failed_gate_run",
    "openvino_artifact",
    "tiny_llm_artifact",
    "tiny_ov_llm_artifact",
    "encoder_artifact",
    "tensor_artifact",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.relative_to(Path(__file__).parent)
        fixtures = set(getattr(item, "fixturenames", ()))
        if module.parts[0] in SLOW_DIRS or module.name in SLOW_MODULES or fixtures & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
    if "PYTEST_XDIST_WORKER" in os.environ:  # every worker collects, in the same order: xdist checks it
        items[:] = heaviest_files_first(items)


def pytest_configure(config: pytest.Config) -> None:
    # xdist queues the files of `--dist loadfile` by their number of tests unless told to keep the
    # collection's order, which lists the longest files first (tests/support/schedule.py).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@dataclass(frozen=True)
class Run:
    proc: subprocess.CompletedProcess  # what the console showed
    artifact: Path


@pytest.fixture(scope="session")
def minilm_run(tmp_path_factory) -> Run:
    """A real INT8 MiniLM artifact built by the pipeline (fast settings), and the run's console output.
    Its cache is its own, so its export always runs here (what it logs is asserted); the other runs at
    these settings share the user's cache, and their exports with it."""

    def build(workdir: Path) -> dict:
        proc = run_optimize(
            "recipe=minilm_int8_cpu",
            *FAST_OVERRIDES,
            f"output_dir={workdir / 'artifact'}",
            f"hydra.run.dir={workdir / 'run'}",
            env={"OPTIMIZE_CACHE": str(workdir / "cache")},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return process_record(proc)

    workdir, record = build_once(tmp_path_factory, "minilm", build)
    return Run(process_of(record), workdir / "artifact")


@pytest.fixture(scope="session")
def minilm_artifact(minilm_run: Run) -> Path:
    return minilm_run.artifact


@dataclass(frozen=True)
class FailedRun:
    proc: subprocess.CompletedProcess
    artifact: Path
    junit: Path  # report.junit
    summary: Path  # GITHUB_STEP_SUMMARY
    outputs: Path  # GITHUB_OUTPUT


@pytest.fixture(scope="session")
def failed_gate_run(tmp_path_factory) -> FailedRun:
    """A real MiniLM run whose gate fails (min_cosine above 1 cannot pass), as CI runs it: with
    report.junit, GitHub's step summary and output files, and publish=mlflow allowing a failed gate
    (the embedded store beside the artifact)."""

    def paths(workdir: Path) -> tuple[Path, ...]:  # artifact, junit, summary, outputs
        return (
            workdir / "out" / "artifact",
            workdir / "reports" / "junit.xml",
            workdir / "step_summary.md",
            workdir / "step_output",
        )

    def build(workdir: Path) -> dict:
        artifact, junit, summary, outputs = paths(workdir)
        summary.write_text("# earlier step\n")  # appended to, never replaced
        proc = run_optimize(
            "recipe=minilm_int8_cpu",
            *FAST_OVERRIDES,
            "gate.min_cosine=1.01",
            f"output_dir={artifact}",
            f"hydra.run.dir={workdir / 'run'}",
            f"report.junit={junit}",
            "publish=mlflow",
            "publish.allow_failed=true",
            env={"GITHUB_STEP_SUMMARY": str(summary), "GITHUB_OUTPUT": str(outputs)},
        )
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        return process_record(proc)

    workdir, record = build_once(tmp_path_factory, "minilm-failed", build)
    return FailedRun(process_of(record), *paths(workdir))


@pytest.fixture(scope="session")
def openvino_artifact(tmp_path_factory) -> Path:
    """A real OpenVINO (NNCF INT8) MiniLM artifact built by the pipeline (fast settings)."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    overrides = [o for o in FAST_OVERRIDES if not o.startswith(("engine=", "quantize"))]

    def build(workdir: Path) -> dict:
        proc = run_optimize(
            "recipe=minilm_int8_cpu",
            *overrides,
            "quantize=none",
            "engine=openvino",
            "engine.params.precision=int8",
            "engine.params.calibration_count=16",
            f"output_dir={workdir / 'artifact'}",
            f"hydra.run.dir={workdir / 'run'}",
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return {}

    workdir, _ = build_once(tmp_path_factory, "minilm-openvino", build)
    return workdir / "artifact"


@dataclass(frozen=True)
class RaceRun:
    proc: subprocess.CompletedProcess
    artifact: Path
    cache: Path  # its OPTIMIZE_CACHE, empty before the run: every candidate was built in it
    config: Path  # its XDG_CONFIG_HOME, which holds the key the cache's records are signed with


@pytest.fixture(scope="session")
def minilm_default_race(tmp_path_factory) -> RaceRun:
    """The default recipe as shipped (the engine race over every default candidate, each built afresh
    in a cache of its own), with small counts; the speed threshold is left to the recipe's own report
    (tests never assert the machine's speed), the fidelity checks stay on. One race for the tests of
    the default recipe, of a candidate it races (openvino_mixed) and of what its cache trusts."""

    def build(workdir: Path) -> dict:
        proc = run_optimize(
            "evaluate.data.count=16",
            "calibration.count=16",
            "evaluate.batch_sizes=[1,4]",
            "evaluate.repeats=5",
            "evaluate.warmup=1",
            "evaluate.retimes=0",  # the other test worker shares the machine: see FAST_OVERRIDES
            # The race's timing of its 9 runners at 2 batch sizes: 4 calls each instead of 16 (27 s of the
            # run); no speed is asserted, only that the fastest passing one ships.
            "engine.params.timing_repeats=4",
            "gate.min_speedup=null",
            f"output_dir={workdir / 'artifact'}",
            f"hydra.run.dir={workdir / 'run'}",
            env={"OPTIMIZE_CACHE": str(workdir / "cache"), "XDG_CONFIG_HOME": str(workdir / "config")},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return process_record(proc)

    workdir, record = build_once(tmp_path_factory, "minilm-default-race", build)
    return RaceRun(process_of(record), workdir / "artifact", workdir / "cache", workdir / "config")
