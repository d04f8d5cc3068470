"""Fuzzing the artifact and bundle entry points with random and hostile arguments: `python -m
optimize.verify`, `python -m optimize.export` and a bundle's `run.py` either succeed (exit 0) or refuse
with exit 2 and one line `error: ...`; never a traceback, and never a file written into the artifact or
the bundle. Each example is a subprocess, so there are only a handful per entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engines.artifact import verify  # noqa: E402
from tests.support.cli import ROOT, one_error_line  # noqa: E402

FUZZ = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure here is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def places(minilm_artifact, tmp_path_factory) -> dict[str, Path]:
    """The real artifact, a bundle exported from it, key files good and bad, and odd paths."""
    root = tmp_path_factory.mktemp("fuzz-places")
    bundle = root / "bundle"
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.export", minilm_artifact, "--bundle", bundle],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (root / "key").write_text("a-key-of-at-least-sixteen-bytes")
    (root / "short-key").write_text("short")
    (root / "busy").mkdir()
    (root / "busy" / "keep.txt").write_text("mine")
    (root / "folder.npy").mkdir()
    os.mkfifo(root / "fifo")
    return {"artifact": minilm_artifact, "bundle": bundle, "root": root}


def paths(places: dict[str, Path]) -> st.SearchStrategy[str]:
    root = places["root"]
    return st.sampled_from(
        [
            str(places["artifact"]),
            str(places["bundle"]),
            str(root / "key"),
            str(root / "short-key"),
            str(root / "busy"),
            str(root / "fifo"),
            str(root / "missing"),
            "/dev/zero",
            "/dev/null",
            "/proc/self",
            "/",
            "",
            "-",
            "~",
            "x" * 300,
            "bad-\udcff-bytes",
            "new-folder",
        ]
    )


WORDS = st.sampled_from(["--help", "-h", "--", "--bogus", "--key", "=", "-1", "0", "1e9", "nan", "é", "\u202e"])


def run(args: list, cwd: Path, stdin: str = "", timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        encoding="utf-8",
        errors="surrogateescape",  # arguments and stdin may hold bytes that are not UTF-8
        timeout=timeout,
    )


def exits_0_or_2(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode in (0, 2), f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    if proc.returncode == 2:
        one_error_line(proc)
    else:
        assert "Traceback" not in proc.stderr


def unchanged(places: dict[str, Path]) -> None:
    assert verify(places["artifact"]) == [] and verify(places["bundle"]) == []


@st.composite
def verify_args(draw, places):
    args = [draw(paths(places))]
    if draw(st.booleans()):
        args += ["--key", draw(paths(places))]
    if draw(st.booleans()):
        args.append("--require-signature")
    args += draw(st.lists(st.one_of(WORDS, paths(places)), max_size=2))
    return draw(st.permutations(args))


@st.composite
def export_args(draw, places, out: Path):
    args = [draw(paths(places)), "--bundle", draw(st.one_of(paths(places), st.just(str(out / "bundle"))))]
    flags = st.sampled_from(["--ort-format", "--allow-failed-gate", "--require-signature"])
    args += draw(st.lists(flags, max_size=2, unique=True))
    if draw(st.booleans()):
        args += ["--key", draw(paths(places))]
    args += draw(st.lists(WORDS, max_size=1))
    return args


def test_verify_exits_0_or_2_on_random_arguments(places, tmp_path_factory):
    @FUZZ
    @given(verify_args(places))
    def check(args):
        exits_0_or_2(run(["-m", "optimize.verify", *args], cwd=tmp_path_factory.mktemp("verify")))

    check()
    unchanged(places)


def test_export_exits_0_or_2_on_random_arguments(places, tmp_path_factory):
    out = tmp_path_factory.mktemp("export-out")

    @FUZZ
    @given(export_args(places, out), st.integers(0, 10**6))
    def check(args, n):
        # A fresh destination per example: relative paths land in a folder of their own.
        cwd = tmp_path_factory.mktemp("export")
        args = [str(out / f"bundle-{n}") if a == str(out / "bundle") else a for a in args]
        exits_0_or_2(run(["-m", "optimize.export", *args], cwd=cwd))
        assert not [p for p in Path(cwd).rglob("*") if ".partial-" in p.name]

    check()
    unchanged(places)


TEXTS = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20),
    st.binary(max_size=12).filter(lambda b: b"\x00" not in b).map(os.fsdecode),  # bytes that may not be UTF-8
)
NUMBERS = st.sampled_from(["0", "1", "2", "-1", "99999999999999999999", "1.5", "x", ""])


@st.composite
def run_py_args(draw, places, out: Path):
    args = draw(st.lists(TEXTS, max_size=3))
    root, bundle = places["root"], places["bundle"]
    outputs = [out / "v.npy", out / "v.json", bundle / "v.npy", root / "folder.npy", Path("/proc/v.npy"), Path("")]
    if draw(st.booleans()):
        args += ["--output", str(draw(st.sampled_from(outputs)))]
    for option in ("--threads", "--batch-size", "--max-tokens"):
        if draw(st.integers(0, 3)) == 0:
            args += [option, draw(NUMBERS)]
    if draw(st.booleans()):
        args += ["--key", draw(paths(places))]
    if draw(st.booleans()):
        args.append("--require-signature")
    args += draw(st.lists(WORDS, max_size=1))
    return args


def test_a_bundles_run_py_exits_0_or_2_on_random_arguments(places, tmp_path_factory):
    out = tmp_path_factory.mktemp("run-out")

    @FUZZ
    @given(run_py_args(places, out), st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")))
    def check(args, stdin):
        exits_0_or_2(run([places["bundle"] / "run.py", *args], cwd=tmp_path_factory.mktemp("run"), stdin=stdin))
        assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left behind

    check()
    unchanged(places)
