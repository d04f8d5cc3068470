"""`python -m optimize.train_classifier`: bad arguments are one line, exit 2, before any training or
writing (training itself is exercised by the recipe it feeds, on an idle machine it takes minutes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cli import ROOT, one_error_line


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--steps", "-1"], "--steps -1: give at least 1"),
        (["--budget-s", "-5"], "--budget-s -5.0: give a positive number of seconds"),
        (["--budget-s", "nan"], "--budget-s nan"),
        (["--threads", "-2"], "--threads -2"),
        (["--trained-layers", "0"], "--trained-layers 0: give at least 1"),
        (["--budget-s", "x"], "invalid float value"),
    ],
)
def test_bad_arguments_are_one_line(args, fragment, tmp_path):
    out = tmp_path / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train_classifier", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    one_error_line(proc, fragment)
    assert not out.exists()


def test_a_file_where_the_folder_goes_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train_classifier", str(target)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    one_error_line(proc, "exists and is not a folder")
    assert target.read_text() == "keep me"
