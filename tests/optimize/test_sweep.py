"""Sweeps (`python -m optimize -m ...`) on Hydra's launchers, and `python -m optimize.reports.compare` on them.

A multirun runs every job (an exit inside the first job used to end the sweep there), each job's exit
code is recorded, and the sweep exits with the worst; the comparison reads every job's verified
manifest into one table."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from optimize.reports.compare import build_table, render_markdown, render_plot
from optimize.sweep import JOBS, record_job, summarize
from tests.support.cli import FAST_OVERRIDES, ROOT, one_error_line, refusal_in_process, run_optimize

# The fast MiniLM recipe with its min_cosine swept: INT8 never reaches 0.9999, so those jobs fail the gate.
BASE = [o for o in FAST_OVERRIDES if not o.startswith("gate.min_cosine=")]
STRICT = 0.9999


def compare(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimize.reports.compare", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


def job_lines(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith("job ")]


@pytest.fixture(scope="module")
def joblib_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    sweep = tmp_path_factory.mktemp("sweep") / "joblib"
    proc = run_optimize(
        "-m",
        "hydra/launcher=local",
        "hydra.launcher.n_jobs=2",
        *BASE,
        f"gate.min_cosine=0.95,{STRICT}",
        "quantize.params.per_channel=true,false",
        f"hydra.sweep.dir={sweep}",
    )
    return sweep, proc


def test_a_joblib_multirun_runs_all_four_jobs_and_exits_with_the_worst(joblib_sweep):
    sweep, proc = joblib_sweep
    lines = job_lines(proc.stdout)
    assert len(lines) == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads((sweep / JOBS / f"{n}.json").read_text()) for n in range(4)]
    verdicts = [json.loads((sweep / str(n) / "artifact" / "manifest.json").read_text())["verdict"] for n in range(4)]
    assert [r["exit_code"] for r in records] == [0 if v == "passed" else 1 for v in verdicts]
    for record, verdict in zip(records, verdicts):
        if f"gate.min_cosine={STRICT}" in record["overrides"]:
            assert verdict == "failed"
    assert proc.returncode == 1  # at least the strict jobs failed their gate; none was refused or crashed
    assert "sweep: exit 1" in proc.stdout


def test_compare_collects_the_sweep_into_one_table(joblib_sweep):
    sweep, _ = joblib_sweep
    proc = compare(sweep)
    assert proc.returncode == 0, proc.stderr
    with open(sweep / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["artifact"] for r in rows] == [f"{n}/artifact" for n in range(4)]
    settings = {(r["gate.min_cosine"], r["quantize.params.per_channel"]) for r in rows}
    assert settings == {(c, p) for c in ("0.95", str(STRICT)) for p in ("true", "false")}
    for n, row in enumerate(rows):
        manifest = json.loads((sweep / str(n) / "artifact" / "manifest.json").read_text())
        fidelity = manifest["metrics"]["candidate"]["fidelity"]
        assert row["verdict"] == manifest["verdict"]
        assert float(row["cosine_min"]) == pytest.approx(fidelity["cosine_min"])
        assert row["engine"] == "onnxruntime" and row["precision"] == "int8"
        # The verdict follows from the table's own figures and thresholds (the other gates are fixed).
        passes = (
            float(row["cosine_min"]) >= float(row["gate.min_cosine"])
            and float(row["cosine_mean"]) >= 0.98
            and float(row["topk_agreement"]) >= 0.5
        )
        assert row["verdict"] == ("passed" if passes else "failed")
    markdown = (sweep / "compare.md").read_text()
    assert "one kind of CPU" in markdown and markdown.count("/artifact |") == 4
    assert (sweep / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_refuses_a_tampered_artifact_and_writes_nothing(joblib_sweep, tmp_path):
    sweep, _ = joblib_sweep
    copy = tmp_path / "sweep"
    shutil.copytree(sweep / "0", copy / "0")
    shutil.copytree(sweep / "1", copy / "1")
    (copy / "1" / "artifact" / "tokenizer" / "tokenizer_config.json").write_text("{}")
    one_error_line(compare(copy), "does not match its manifest", "tokenizer_config.json")
    one_error_line(compare(tmp_path / "missing"), "missing")
    (tmp_path / "empty").mkdir()
    one_error_line(compare(tmp_path / "empty"), "no artifact")
    one_error_line(compare(copy / "0" / "artifact"), "--out")
    one_error_line(compare(copy / "0" / "artifact", "--out", copy / "0" / "artifact"), "inside the artifact")
    assert not list(copy.rglob("compare.*")) and not list(tmp_path.glob("empty/*"))


def test_a_failed_artifact_is_bundled_only_when_asked(joblib_sweep, tmp_path):
    sweep, _ = joblib_sweep
    failed = next(
        sweep / str(n) / "artifact"
        for n in range(4)
        if json.loads((sweep / str(n) / "artifact" / "manifest.json").read_text())["verdict"] == "failed"
    )
    export = [sys.executable, "-m", "optimize.export", str(failed), "--bundle"]
    refused = subprocess.run([*export, str(tmp_path / "a")], cwd=ROOT, capture_output=True, text=True)
    one_error_line(refused, "the gate did not pass", "--allow-failed-gate")
    assert not (tmp_path / "a").exists()
    allowed = subprocess.run(
        [*export, str(tmp_path / "b"), "--allow-failed-gate"], cwd=ROOT, capture_output=True, text=True
    )
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["verdict"] == "failed"


def test_the_submitit_launchers_local_executor_runs_each_job_as_a_subprocess(tmp_path):
    """hydra/launcher=slurm_local: submitit's job files and worker processes, as on SLURM. One job is
    refused when it loads its data (more calibration items than the source has), the other passes."""
    sweep = tmp_path / "submitit"
    proc = run_optimize(
        "-m",
        "hydra/launcher=slurm_local",
        *BASE,
        "gate.min_cosine=0.95",
        "calibration.count=100000,16",
        f"hydra.sweep.dir={sweep}",
    )
    lines = job_lines(proc.stdout)
    assert len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "calibration.count=100000]: exit 2" in lines[0] and "calibration.count=16]: exit 0" in lines[1]
    assert proc.returncode == 2
    logs = list((sweep / ".submitit").rglob("*_log.err"))
    assert len(logs) == 2, "submitit wrote no job logs"
    # The refused job's one line is in its submitit log (SLURM jobs have no terminal).
    assert any("error: data source cpython_docs has" in log.read_text() for log in logs)
    assert not (sweep / "0").exists() and (sweep / "1" / "artifact" / "manifest.json").is_file()


def test_with_hydras_own_launcher_a_job_refused_at_run_time_does_not_stop_the_next(tmp_path):
    """The basic launcher runs the jobs one after the other in this process: the first job's refusal
    (more calibration items than the source has, which only loading the data finds) used to end the
    sweep with it; now the second job runs, and the sweep exits 2."""
    sweep = tmp_path / "basic"
    proc = run_optimize("-m", *BASE, "gate.min_cosine=0.95", "calibration.count=100000,16", f"hydra.sweep.dir={sweep}")
    lines = job_lines(proc.stdout)
    assert len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "calibration.count=100000]: exit 2 (bad input" in lines[0]
    assert "calibration.count=16]: exit 0 (gate passed)" in lines[1]
    assert proc.returncode == 2 and "sweep: exit 2" in proc.stdout
    assert "error: data source cpython_docs has" in proc.stderr and "asks for 100000" in proc.stderr
    assert not (sweep / "0").exists() and (sweep / "1" / "artifact" / "manifest.json").is_file()


def test_bad_sweeps_are_refused_before_any_job_starts(tmp_path):
    """The first through the real command (its exit code, nothing written), the others through the
    command's own check in this process."""
    sweep = tmp_path / "sweep"
    one_error_line(run_optimize("-m", *BASE, "gate.min_cosine=0.95,abc", f"hydra.sweep.dir={sweep}"), "min_cosine")
    refuse = refusal_in_process
    one_error_line(refuse("-m", *BASE, "gate.min_cosin=0.95,0.99", f"hydra.sweep.dir={sweep}"), "min_cosin")
    one_error_line(
        refuse("-m", *BASE, "gate.min_cosine=0.95,0.99", f"output_dir={tmp_path / 'one'}", f"hydra.sweep.dir={sweep}"),
        "same for 2 jobs",
    )
    one_error_line(refuse("-m", "--cfg", "job"), "--cfg")
    if shutil.which("srun") is None:  # not a SLURM node: the SLURM launcher cannot submit from here
        slurm = refuse("-m", "hydra/launcher=slurm", *BASE, "gate.min_cosine=0.95,0.99", f"hydra.sweep.dir={sweep}")
        one_error_line(slurm, "no srun", "hydra/launcher=slurm_local")
    assert not sweep.exists() and not (tmp_path / "one").exists()


def test_the_ray_launcher_is_named_when_its_plugin_is_missing(tmp_path):
    """hydra-ray-launcher requires cloudpickle<3 and joblib >=3: it is not installed beside the joblib
    launcher, so its config is refused with one line that says what to install."""
    try:
        import hydra_plugins.hydra_ray_launcher  # noqa: F401

        pytest.skip("hydra-ray-launcher is installed here")
    except ImportError:
        pass
    proc = refusal_in_process(
        "-m", "hydra/launcher=ray_cluster", *BASE, "gate.min_cosine=0.95,0.99", f"hydra.sweep.dir={tmp_path / 's'}"
    )
    one_error_line(proc, "hydra/launcher/ray", "pip install hydra-ray-launcher")
    assert not (tmp_path / "s").exists()


def test_the_ray_launcher_runs_the_jobs_as_ray_tasks(tmp_path):
    """Only where hydra-ray-launcher is installed (it cannot be beside the joblib launcher: see
    test above). A private Ray instance on this machine (`ray.init.address=null`: started for the
    sweep and gone with it) stands in for a cluster; the config is otherwise the shipped one."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    sweep = tmp_path / "ray"
    proc = run_optimize(
        "-m",
        "hydra/launcher=ray_cluster",
        "hydra.launcher.ray.init.address=null",
        "+hydra.launcher.ray.init.num_cpus=2",
        "hydra.launcher.ray.remote.num_cpus=1",
        *BASE,
        f"gate.min_cosine=0.95,{STRICT}",
        f"hydra.sweep.dir={sweep}",
        env={"RAY_USAGE_STATS_ENABLED": "0"},
    )
    lines = job_lines(proc.stdout)
    assert len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exit 0" in lines[0] and "exit 1" in lines[1] and proc.returncode == 1
    assert all((sweep / str(n) / "artifact" / "manifest.json").is_file() for n in range(2))


def test_a_job_that_left_no_record_counts_as_an_internal_error(tmp_path):
    class Job:  # the fields of Hydra's job config that record_job reads
        def __init__(self, num):
            self.sweep = type("S", (), {"dir": str(tmp_path)})
            self.job = type("J", (), {"num": num})
            self.overrides = type("O", (), {"task": ["gate.min_cosine=0.9", f"seed={num}"]})

    record_job(0, Job(0), tmp_path / "0" / "artifact")
    record_job(2, Job(1), None)
    code, lines = summarize(tmp_path, 3)
    assert code == 3
    assert lines[0].startswith("job 0 [seed=0]: exit 0 (gate passed)")
    assert lines[1].startswith("job 1 [seed=1]: exit 2 (bad input")
    assert lines[2].startswith("job 2: no exit code recorded")
    assert summarize(tmp_path, 2)[0] == 2
    # A sweeper that ran more jobs than the lists say (Optuna): every record counts, and the gap too.
    record_job(1, Job(3), tmp_path / "3" / "artifact")
    code, lines = summarize(tmp_path, 2)
    assert code == 3 and len(lines) == 4 and lines[3].startswith("job 3 [seed=3]: exit 1 (gate failed)")


def test_compare_says_when_the_cpus_differ_and_plots_them_apart(joblib_sweep):
    """Two manifests that differ in the CPU they were measured on (edited in memory: a second machine
    is not available here)."""
    sweep, _ = joblib_sweep
    manifests = [json.loads((sweep / str(n) / "artifact" / "manifest.json").read_text()) for n in range(2)]
    manifests[1]["environment"]["cpu"] = {"model": "Intel Xeon", "cores": 8, "features": ["avx2", "amx"]}
    manifests[0]["metrics"]["candidate"]["speedup"] = {"1": 2.5}  # as a timed run records it
    table = build_table(["a", "b"], manifests)
    markdown = render_markdown(table)
    assert "| speedup_b1 |" in markdown and "| 2.50x |" in markdown and "| - |" in markdown
    assert markdown.startswith("**These artifacts were measured on 2 different CPUs**")
    assert markdown.splitlines()[2].endswith("| cpu |")  # the CPU column is shown when they differ

    def png_width(png: bytes) -> int:
        return int.from_bytes(png[16:20], "big")  # the IHDR chunk's width field

    assert png_width(render_plot(table)) > 1.8 * png_width(render_plot(build_table(["a"], manifests[:1])))
