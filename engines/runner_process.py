"""A causal-LM Runner in a process of its own, for timing generation as a server runs it.

Runtimes loaded side by side in one process slow each other down. Timed beside PyTorch and an
OpenVINO GenAI pipeline in one process, SmolLM2 INT4 decoded at 205 tok/s on ONNX Runtime GenAI and
125-132 tok/s on OpenVINO GenAI; in processes of their own, in the same run, at 223-241 and 140-154
tok/s (2-core AMD EPYC, 2026-11-30). A server loads one runtime, so each timed candidate gets a
process with only its own engine loaded (`engines.load_engine`), and the caller keeps interleaving
the runs as before. The worker is a child process: OtherCpuUse counts its CPU time as the run's own.

The worker answers JSON lines on stdin/stdout: {"op": "stream", "ids": [...], "n": N} ->
{"stamps": [...]}, the perf_counter() after each generated token. On Linux perf_counter is
CLOCK_MONOTONIC, shared by every process, so the caller measures time to first token from its own
clock reading taken before the request. Anything a runtime prints goes to stderr, not the protocol.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


class RunnerProcessError(RuntimeError):
    """The worker could not load the engine, or exited."""


class WorkerProcess:
    """A child process answering JSON-line requests: `call(request) -> reply`, a reply with "error"
    raised as RunnerProcessError; {"op": "exit"} on close() (or leaving `with`) ends it."""

    name = "worker"

    def __init__(self, command: list[str], env: dict | None = None):
        # stderr goes to a file: a pipe nobody reads would block a worker that prints a lot.
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env
        )

    def call(self, request: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: readline below returns "" and the error says why
        line = self.proc.stdout.readline()
        if not line:
            raise RunnerProcessError(f"the {self.name} exited (code {self.proc.wait()}): {self._last_error_line()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RunnerProcessError(f"the {self.name}: {reply['error']}")
        return reply

    def _last_error_line(self) -> str:
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().splitlines() if line.strip()]
        return lines[-1][:300] if lines else "no output"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"})
            except RunnerProcessError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class RunnerProcess(WorkerProcess):
    """`timed_stream` and `greedy` of the engine at root/engine, run in a child process (close() or
    `with` ends it)."""

    name = "timing worker"

    def __init__(self, root: str | Path, engine: dict, threads: int = 0):
        package_parent = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))
        super().__init__([sys.executable, "-m", "engines.runner_process"], dict(os.environ, PYTHONPATH=path))
        try:
            self.call({"op": "load", "root": str(root), "engine": engine, "threads": threads})
        except RunnerProcessError:
            self.close()
            raise

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        return self.call({"op": "stream", "ids": [int(i) for i in prompt_ids], "n": int(new_tokens)})["stamps"]

    def greedy(self, prompt_ids, new_tokens: int) -> list[int]:
        """Greedy continuation ids, generated in the child (engines.generation.greedy_ids)."""
        return self.call({"op": "greedy", "ids": [int(i) for i in prompt_ids], "n": int(new_tokens)})["ids"]


def _answer(request: dict, state: dict) -> dict:
    op = request.get("op")
    if op == "load":
        from engines import load_engine

        state["runner"] = load_engine(Path(request["root"]), request["engine"], threads=int(request["threads"]))
        return {}
    if op == "stream":
        return {"stamps": state["runner"].timed_stream(request["ids"], request["n"])}
    if op == "greedy":
        from engines.generation import greedy_ids

        return {"ids": [int(t) for t in greedy_ids(state["runner"], request["ids"], request["n"])]}
    if op == "exit":
        return {}
    return {"error": f"unknown op {op!r}"}


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the runtimes print goes to stderr
    state: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = _answer(request, state)
        except Exception as exc:  # handed back as one line; the caller raises it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
        if request.get("op") == "exit":
            return


if __name__ == "__main__":
    main()
