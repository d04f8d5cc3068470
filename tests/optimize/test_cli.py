"""The command line as a user meets it: exit codes, one-line errors, nothing half-written. The
process boundary (exit code, stderr, nothing written) is checked on a real `python -m optimize`; the
other refusals run the command's own check in this process (refusal_in_process)."""

import json

import pytest

from tests.support.cli import one_error_line, refusal_in_process, run_optimize


def test_unknown_key_exits_2_naming_the_key(tmp_path):
    one_error_line(run_optimize("gate.nonexistent=1", f"hydra.run.dir={tmp_path}"), "nonexistent")


def test_missing_model_source_exits_2(tmp_path):
    out = tmp_path / "out"
    proc = refusal_in_process("model.source=/no/such/dir", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "/no/such/dir", "no such file or directory")
    assert not out.exists()


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("recipe=no_such_recipe", "recipe/no_such_recipe"),
        ("gate.min_cosine=high", "gate.min_cosine"),
        ("quantize.params.bogus=1", "bogus"),
        ("evaluate.batch_sizes=[1,x]", "batch_sizes"),
        ("evaluate.retimes=-1", "evaluate.retimes=-1: give a whole number of runs, 0 or more"),
        ("evaluate.retimes=many", "evaluate.retimes"),
    ],
)
def test_bad_overrides_exit_2(override, fragment, tmp_path):
    one_error_line(refusal_in_process(override, f"hydra.run.dir={tmp_path}"), fragment)


def test_pickled_checkpoints_are_refused_with_the_way_to_opt_in(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    proc = refusal_in_process(f"model.source={folder}", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "pickled", "model.allow_pickle=true")
    proc = refusal_in_process(f"model.source={tmp_path / 'weights.pt'}", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "no such file")
    (tmp_path / "weights.pt").write_bytes(b"x")
    proc = refusal_in_process(f"model.source={tmp_path / 'weights.pt'}", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "pickled checkpoint")


def test_existing_output_dir_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = refusal_in_process(f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "already exists")
    assert (out / "keep.txt").read_text() == "precious"


def test_unreadable_calibration_source_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_optimize(
        "calibration.source=text_file",
        f"calibration.path={tmp_path / 'missing.txt'}",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_error_line(proc, "missing.txt")
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_cfg_job_prints_the_resolved_recipe(tmp_path):
    proc = run_optimize("--cfg", "job", "gate.min_speedup=2.0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "min_speedup: 2.0" in proc.stdout and "method: auto" in proc.stdout


def test_verify_command(minilm_artifact, tmp_path):
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "copy"
    shutil.copytree(minilm_artifact, copy)
    ok = subprocess.run([sys.executable, "-m", "optimize.verify", str(copy)], capture_output=True, text=True)
    assert ok.returncode == 0 and "match the manifest; gate passed" in ok.stdout
    (copy / "tokenizer" / "tokenizer.json").write_text("{}")
    bad = subprocess.run([sys.executable, "-m", "optimize.verify", str(copy)], capture_output=True, text=True)
    assert bad.returncode == 1 and "changed file tokenizer/tokenizer.json" in bad.stdout
    missing = subprocess.run([sys.executable, "-m", "optimize.verify", str(tmp_path)], capture_output=True, text=True)
    one_error_line(missing)
