"""Engines: exporters and builders, each giving a Runner.

A Runner is called on a batch of named numpy arrays and returns named numpy arrays. The same
Runner is what the pipeline measures and what serve/ runs. This package imports on a CPU-only
machine without torch: each engine imports its runtime inside the functions that need it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from engines.artifact import ArtifactError, read_manifest


class Runner(Protocol):
    input_names: list[str]
    output_names: list[str]

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def load(artifact_dir: str | Path, threads: int = 0, spinning: bool = True) -> Runner:
    """Build the Runner an artifact's manifest describes (its `engine` block)."""
    root = Path(artifact_dir)
    engine = read_manifest(root).get("engine") or {}
    return load_engine(root, engine, threads=threads, spinning=spinning)


def load_engine(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> Runner:
    """`spinning=False` for servers: idle ONNX Runtime threads sleep instead of busy-waiting."""
    fmt = engine.get("format")
    if fmt == "onnxruntime":
        from engines.onnxruntime_runner import OrtRunner

        return OrtRunner(root / engine["file"], threads=threads, providers=engine.get("providers"),
                         spinning=spinning)
    if fmt == "pytorch":
        from engines.pytorch_runner import load_pytorch_runner

        return load_pytorch_runner(root, engine, threads=threads)
    if fmt == "onnxruntime-genai":
        from engines.genai_runner import load_genai_runner

        return load_genai_runner(root, engine, threads=threads)
    if fmt == "openvino":
        from engines.openvino_runner import load_openvino_runner

        return load_openvino_runner(root, engine, threads=threads, spinning=spinning)
    if fmt == "modelopt-torch":  # simulated quantization: evaluated by the pipeline, not served
        from optimize.modelopt_methods import load_modelopt_runner

        return load_modelopt_runner(root, engine, threads=threads)
    raise ArtifactError(f"unknown engine format {fmt!r} in {root}")
