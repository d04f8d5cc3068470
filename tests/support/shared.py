"""Session artifacts built once per test run, also when pytest-xdist runs the tests in several worker
processes (`pytest -n 2`): each worker has its own session, so a plain session fixture would build
the same artifact once per worker, on a machine whose cores the workers already share.

The first worker to ask builds the artifact into the run's shared temporary folder, under a file
lock; the others wait on the lock and read what it recorded. Without xdist the artifact is built in
the session's own temporary folder, as a plain session fixture does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

RECORD = "record.json"


def build_once(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """`build(workdir)` builds into the empty `workdir` and returns a JSON-serializable record of the
    build (what a test reads of it besides the files). Returns (workdir, record). A build that raises
    records nothing: the next worker that needs it tries again (and fails the same way)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        workdir = tmp_path_factory.mktemp(name)
        return workdir, build(workdir)
    from filelock import FileLock

    shared_root = tmp_path_factory.getbasetemp().parent  # the run's folder; each worker's is below it
    workdir, record = shared_root / name, shared_root / f"{name}.{RECORD}"
    with FileLock(str(shared_root / f"{name}.lock")):
        if record.is_file():
            return workdir, json.loads(record.read_text())
        shutil.rmtree(workdir, ignore_errors=True)  # what a failed build left
        workdir.mkdir()
        result = build(workdir)
        record.write_text(json.dumps(result))
        return workdir, result


def process_record(proc: subprocess.CompletedProcess) -> dict:
    """A finished command as a record for build_once."""
    return {"args": list(proc.args), "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def process_of(record: dict) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(record["args"], record["returncode"], record["stdout"], record["stderr"])
