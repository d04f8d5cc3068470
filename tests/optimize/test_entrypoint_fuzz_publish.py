"""Fuzzing `python -m optimize.publish` and `python -m optimize.reports.compare` with random and hostile
arguments, through the real command line: every call ends with exit 0, or exit 2 and one line
`error: ...`; never a traceback. A real artifact is among the inputs, so the checks past the argument
parser are reached. Subprocesses are slow, so each test runs a handful of examples. No network: the
Hub is offline without a token, and every URI is on loopback or local."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("mlflow")
pytest.importorskip("huggingface_hub")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support.cli import ROOT, one_error_line  # noqa: E402

FUZZ = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=16)
HOSTILE = ["", "-", "\n", "x\ny", "/proc/self", "/proc/x/y", "/dev/null", "..", "a" * 300, "$\\frac{$", "🙂"]


def run(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "ARTIFACT_VERIFY_KEY")}
    env.update(HF_HUB_OFFLINE="1", HF_TOKEN="", HF_HOME=str(cwd / "hf-home"), MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def exit_0_or_one_line(proc: subprocess.CompletedProcess, argv: list[str]) -> None:
    assert proc.returncode in (0, 2), f"{argv!r}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    if proc.returncode == 2:
        one_error_line(proc)


@pytest.fixture(scope="module")
def playground(minilm_artifact, tmp_path_factory) -> Path:
    """A real artifact (copied: a publish may write its default store beside it), a key file, a file
    that is no database, an empty folder and a plain file."""
    root = tmp_path_factory.mktemp("fuzz-publish")
    shutil.copytree(minilm_artifact, root / "out" / "artifact")
    (root / "key").write_bytes(b"k" * 32)
    (root / "short-key").write_bytes(b"k")
    (root / "junk.db").write_text("not a database\n")
    (root / "empty").mkdir()
    (root / "a-file").write_text("x")
    return root


def _paths(root: Path) -> list[str]:
    return [
        str(root / "out" / "artifact"),
        str(root / "out" / "artifact" / "inside"),
        str(root / "missing"),
        str(root / "empty"),
        str(root / "a-file"),
        *HOSTILE,
    ]


def publish_argv(root: Path):
    uris = [
        "foo://bar",
        "sqlite://garbage",
        "sqlite:////proc/x.db",
        f"sqlite:///{root / 'junk.db'}",
        f"sqlite:///{root / 'new' / 'store.db'}",
        "http://user:pw@127.0.0.1:9",
        "https://127.0.0.1:9",
        "http://[::1",
        "http://127.0.0.1:99999",
        "postgresql://127.0.0.1:9/db",
        "file:///proc/x",
        "databricks",
        "sqlite:///" + "x" * 300,
    ]
    options = st.one_of(
        st.tuples(st.just("--tracking-uri"), st.one_of(st.sampled_from(uris), TEXT)),
        st.tuples(st.just("--repo-id"), st.one_of(st.sampled_from(["acme/m", "a/b/c", "acme/", *HOSTILE]), TEXT)),
        st.tuples(st.just("--folder"), st.sampled_from([str(root / "new-folder"), *_paths(root)])),
        st.tuples(st.just("--key"), st.sampled_from([str(root / "key"), str(root / "short-key"), *_paths(root)])),
        st.tuples(st.sampled_from(["--experiment", "--model-name"]), st.one_of(st.sampled_from(HOSTILE), TEXT)),
        st.tuples(st.sampled_from(["--dry-run", "--allow-failed", "--require-signature", "--public", "--bogus"])),
        st.tuples(TEXT),
    )
    return st.builds(
        lambda artifact, to, extra: [artifact, *to, *[part for option in extra for part in option]],
        st.sampled_from(_paths(root)),
        st.sampled_from([("--to", "mlflow"), ("--to", "hf_hub"), ("--to", "s3"), ()]),
        st.lists(options, max_size=4),
    )


def compare_argv(root: Path):
    # Not "..": the tree above holds the other tests' artifacts, each hashed again on every call.
    folders = [str(root / "out"), *(p for p in _paths(root) if p != "..")]
    return st.builds(
        lambda dirs, out: [*dirs, *out],
        st.lists(st.one_of(st.sampled_from(folders), TEXT), min_size=0, max_size=3),
        st.one_of(st.just(()), st.tuples(st.just("--out"), st.sampled_from([str(root / "empty"), *folders]))),
    )


@FUZZ
@given(data=st.data())
def test_publish_exits_0_or_refuses_in_one_line(playground, data):
    argv = data.draw(publish_argv(playground))
    exit_0_or_one_line(run("optimize.publish", argv, playground), argv)


@FUZZ
@given(data=st.data())
def test_compare_exits_0_or_refuses_in_one_line(playground, data):
    argv = data.draw(compare_argv(playground))
    exit_0_or_one_line(run("optimize.reports.compare", argv, playground), argv)


def test_what_the_fuzzer_found_is_one_line():
    """Two inputs Hypothesis drew: an argument holding a carriage return, and an SQLite path longer than
    the file system takes (it raised OSError, a traceback with exit 1)."""
    from optimize.errors import RecipeError
    from optimize.publish.mlflow_registry import _check_sqlite

    proc = subprocess.run(
        [sys.executable, "-m", "optimize.publish", "x", "--to", "mlflow", "\r0"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    with pytest.raises(RecipeError, match="File name too long; nothing published"):
        _check_sqlite("sqlite:///" + "x" * 300)
