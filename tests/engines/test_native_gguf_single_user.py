"""benchmarks/llamacpp_single_user.py (the native engine against llama-server and llama-bench for one
user): what it is given that cannot give a figure is one line and exit 2 before anything starts, and
both sides read the same seeded prompt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.llamacpp_single_user", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["missing.gguf"], "missing.gguf: no such .gguf file"),
        (["x.gguf", "--rounds", "0"], "--rounds 0: from 1 to 100"),
        (["x.gguf", "--prompt", "0"], "--prompt 0: from 1 to 32768"),
        (["x.gguf", "--tokens", "5000"], "--tokens 5000: from 1 to 4096"),
    ],
)
def test_what_cannot_give_a_figure_is_one_line_and_exit_2(args, says):
    done = _run(*args)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"error: {says}"]


def test_a_llama_server_path_that_is_no_program_is_one_line(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    done = _run(str(gguf), "--llama-server", str(tmp_path / "nothing"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "no such executable" in done.stderr


def test_the_prompt_is_seeded_and_stays_inside_the_vocabulary():
    from benchmarks.llamacpp_single_user import prompt_ids

    ids = prompt_ids(49152, 1024)
    assert ids == prompt_ids(49152, 1024) and len(ids) == 1024
    assert 100 <= min(ids) and max(ids) < 49152 - 100
    assert max(prompt_ids(64, 32)) < 64
