"""`python -m serve` refuses bad input before loading anything: one line `error: ...`, exit 2.
Tampered copies are real copies (an artifact with a hard link is refused: engines/artifact/), so
the session's artifact is never modified."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engines.artifact import seal
from serve.config import API_KEY_ENV
from tests.support.cli import one_error_line
from tests.support.serve import ROOT, running_server


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serve", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def clone(artifact: Path, dest: Path) -> Path:
    """A copy of every file (hard links would be refused, and would share the session's artifact)."""
    shutil.copytree(artifact, dest)
    return dest


@pytest.mark.parametrize(
    "args, words",
    [
        (["/no/such/dir"], ["not a directory"]),
        ([str(ROOT / "calibration")], ["not an artifact"]),
        ([], ["artifact"]),
        (["ARTIFACT", "--max-batch-size", "0"], ["--max-batch-size"]),
        (["ARTIFACT", "--port", "http"], ["--port"]),
        (["ARTIFACT", "--no-such-flag"], ["--no-such-flag"]),
        (["ARTIFACT", "--threads", "99999999999999"], ["--threads", "<= 1024"]),
        (["ARTIFACT", "--host", "bad..host"], ["--host bad..host", "not an address this machine can listen on"]),
        (["ARTIFACT", "--host", "192.0.2.1"], ["cannot listen on 192.0.2.1:8000"]),  # TEST-NET-1: no host has it
    ],
)
def test_bad_command_lines(encoder_artifact, args, words):
    args = [str(encoder_artifact) if a == "ARTIFACT" else a for a in args]
    one_error_line(serve(*args), *words)


def test_a_port_another_process_holds_is_refused_before_the_model_loads(encoder_artifact):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        one_error_line(serve(str(encoder_artifact), "--port", str(port)), f"127.0.0.1:{port}", "Address already in use")


def test_changed_file_refuses_to_start(encoder_artifact, tmp_path):
    copy = clone(encoder_artifact, tmp_path / "a")
    config = copy / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text() + " ")
    one_error_line(serve(str(copy)), "changed file tokenizer/tokenizer_config.json", "--allow-modified")


def test_missing_and_unexpected_files_refuse_to_start(encoder_artifact, tmp_path):
    copy = clone(encoder_artifact, tmp_path / "a")
    (copy / "tokenizer" / "tokenizer_config.json").unlink()
    one_error_line(serve(str(copy)), "missing file tokenizer/tokenizer_config.json")
    copy = clone(encoder_artifact, tmp_path / "b")
    (copy / "extra.bin").write_bytes(b"x")
    one_error_line(serve(str(copy)), "unexpected file extra.bin")


def test_failed_gate_refuses_to_start(encoder_artifact, tmp_path):
    copy = clone(encoder_artifact, tmp_path / "a")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["gate"]["passed"] = False
    manifest["gate"]["checks"][0]["passed"] = False
    (copy / "manifest.json").write_text(json.dumps(seal(manifest)))  # an artifact whose gate failed
    one_error_line(serve(str(copy)), "gate did not pass", manifest["gate"]["checks"][0]["name"], "--allow-failed-gate")


def test_broken_manifest_refuses_to_start(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    one_error_line(serve(str(tmp_path)), "not valid JSON")


def test_overrides_serve_a_modified_failed_artifact_and_say_so(encoder_artifact, tmp_path):
    copy = clone(encoder_artifact, tmp_path / "a")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["gate"]["passed"] = False
    (copy / "manifest.json").write_text(json.dumps(seal(manifest)))  # an artifact whose gate failed
    config = copy / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text() + " ")
    with running_server(copy, "--allow-modified", "--allow-failed-gate") as server:
        assert "serving a modified artifact" in server.output
    assert server.proc.returncode == 0


@pytest.mark.parametrize("key", ["", " ", "\t\n", " padded "])
def test_a_blank_api_key_refuses_to_start(encoder_artifact, key):
    # A blank key used to mean "no key": the server started with auth silently off.
    words = ["whitespace"] if key.strip() else ["empty or blank"]
    one_error_line(serve(str(encoder_artifact), "--api-key", key), "--api-key", *words)
    env = {**os.environ, API_KEY_ENV: key}
    proc = subprocess.run(
        [sys.executable, "-m", "serve", str(encoder_artifact)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    one_error_line(proc, API_KEY_ENV, *words)
