"""Helpers for the serve tests: a real `python -m serve` subprocess on loopback, and in-process apps."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT_LINE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


class ServerProcess:
    """`python -m serve ARTIFACT --port 0 ...`; the port is read from uvicorn's startup line.
    With `token_delay_s`, a causal LM's tokens come that much apart (see slow_generation)."""

    def __init__(self, artifact: Path, *args: str, env: dict | None = None, token_delay_s: float | None = None):
        self.lines: list[str] = []
        self.port_found = threading.Event()
        self.port = None
        command = ["-m", "serve"] if token_delay_s is None else ["-m", "tests.support.serve", str(token_delay_s)]
        self.proc = subprocess.Popen(
            [sys.executable, *command, str(artifact), "--host", "127.0.0.1", "--port", "0", *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self.read_output, daemon=True).start()

    def read_output(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            match = PORT_LINE.search(line)
            if match:
                self.port = int(match.group(1))
                self.port_found.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 60, headers: dict | None = None) -> "ServerProcess":
        import httpx

        if not self.port_found.wait(timeout):
            raise AssertionError(f"server did not start:\n{self.output}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v2/health/ready", headers=headers, timeout=2).status_code == 200:
                    return self
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.output}")

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"server did not stop within {timeout} s:\n{self.output}") from None


@contextlib.contextmanager
def running_server(
    artifact: Path, *args: str, env: dict | None = None, headers: dict | None = None, token_delay_s: float | None = None
):
    server = ServerProcess(artifact, *args, env=env, token_delay_s=token_delay_s)
    try:
        yield server.wait_ready(headers=headers)
    finally:
        server.terminate()


@contextlib.contextmanager
def in_process(artifact: Path, wait: bool = True, **settings):
    """The app with Starlette's TestClient (lifespan included): no sockets, same code path."""
    from starlette.testclient import TestClient

    from serve.app import create_app
    from serve.config import ServeConfig

    load_model = settings.pop("load_model", None)
    kwargs = {"load_model": load_model} if load_model else {}
    app = create_app(artifact, ServeConfig(**settings), **kwargs)
    with TestClient(app, raise_server_exceptions=False) as client:
        if wait:
            wait_until(lambda: app.state.serve.model is not None or app.state.serve.load_error)
        yield client


def wait_until(condition, timeout: float = 60, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not met in time")


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def kserve_tensors(ids) -> list[dict]:
    """JSON inputs for the encoder from token ids [rows, seq] (no padding: all ones mask)."""
    import numpy as np

    ids = np.asarray(ids, dtype=np.int64)
    tensors = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return [
        {"name": n, "datatype": "INT64", "shape": list(a.shape), "data": a.reshape(-1).tolist()}
        for n, a in tensors.items()
    ]


def slow_generation(delay_s: float) -> None:
    """Hold every generated token for `delay_s` (in the generation thread, as a slower model would):
    the tiny test LLM writes a whole stream in milliseconds, too fast for a client to leave in the
    middle of one or for a stream to outlast a deadline. Continuous batching: every engine step
    takes that much longer, so every stream's tokens come that far apart."""
    from engines.onnxruntime_genai.runner import GenAIRunner

    def slowed(generate):
        def slowed_generate(self, *args, **kwargs):
            for item in generate(self, *args, **kwargs):
                time.sleep(delay_s)
                yield item

        return slowed_generate

    GenAIRunner.generate = slowed(GenAIRunner.generate)  # type: ignore[method-assign]
    from engines.onnxruntime_genai.batch import GenAIBatchEngine

    genai_step = GenAIBatchEngine.step

    def slowed_genai_step(self):
        time.sleep(delay_s)
        genai_step(self)

    GenAIBatchEngine.step = slowed_genai_step  # type: ignore[method-assign]
    with contextlib.suppress(ImportError):
        from engines.openvino.genai_batch import OVGenAIBatchEngine
        from engines.openvino.genai_runner import OVGenAIRunner

        OVGenAIRunner.generate = slowed(OVGenAIRunner.generate)  # type: ignore[method-assign]
        step = OVGenAIBatchEngine.step

        def slowed_step(self):
            time.sleep(delay_s)
            step(self)

        OVGenAIBatchEngine.step = slowed_step  # type: ignore[method-assign]


if __name__ == "__main__":  # python -m tests.support.serve TOKEN_DELAY_S ARTIFACT [serve's arguments]
    from serve.__main__ import main

    slow_generation(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
