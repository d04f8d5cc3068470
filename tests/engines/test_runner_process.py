"""engines/runner_process.py: a causal-LM runner timed in a worker process of its own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.models import tiny_llama_folder


@pytest.fixture(scope="module")
def tiny_genai(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny random Llama through ONNX Runtime GenAI's builder (FP32): (root, engine block)."""
    from engines.onnxruntime_genai.build import build

    root = tmp_path_factory.mktemp("genai")
    source = tiny_llama_folder(root / "src")
    build(source, root / "genai", "fp32", "cpu", [], root / "cache")
    return root, {"format": "onnxruntime-genai", "dir": "genai", "providers": ["CPUExecutionProvider"]}


@pytest.mark.slow
def test_worker_streams_tokens_on_the_callers_clock(tiny_genai):
    from engines.runner_process import RunnerProcess

    root, engine = tiny_genai
    with RunnerProcess(root, engine, threads=1) as worker:
        start = time.perf_counter()
        stamps = worker.timed_stream([1, 20, 30, 40], 6)
        end = time.perf_counter()
        assert worker.proc.poll() is None  # still serving
    assert len(stamps) == 6
    # perf_counter is CLOCK_MONOTONIC, shared across processes: the worker's stamps fall inside
    # the caller's window, in order, so the caller can take TTFT as stamps[0] - start.
    assert start < stamps[0] <= stamps[-1] < end
    assert stamps == sorted(stamps)
    assert worker.proc.poll() == 0  # exited cleanly on close


@pytest.mark.slow
def test_the_worker_generates_the_same_greedy_continuation_as_the_engine_in_process(tiny_genai):
    from engines import load_engine
    from engines.generation import greedy_ids
    from engines.runner_process import RunnerProcess

    root, engine = tiny_genai
    prompt = [1, 20, 30, 40]
    with RunnerProcess(root, engine, threads=1) as worker:
        ids = greedy_ids(worker, prompt, 6)
    assert len(ids) <= 6 and all(isinstance(i, int) for i in ids)  # a random model may end at EOS sooner
    assert ids == greedy_ids(load_engine(root, engine, threads=1), prompt, 6)


def test_an_engine_the_worker_cannot_load_is_one_line(tmp_path):
    from engines.runner_process import RunnerProcess, RunnerProcessError

    with pytest.raises(RunnerProcessError) as failure:
        RunnerProcess(tmp_path, {"format": "onnxruntime-genai", "dir": "missing"}, threads=1)
    message = str(failure.value)
    assert "\n" not in message and message.startswith("the timing worker:")
