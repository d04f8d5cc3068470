"""The two sides the harness compares, built one way for the race and the final evaluation: the
baseline (the source model as it came, on its own runtime) and a candidate (an engine's files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines import engine_bytes, formats, load_engine
from engines.runners import TensorRunner
from optimize.evaluate.harness import Subject


def baseline(ctx, task) -> Subject:
    """PyTorch FP32 through the task's baseline runner, or ONNX Runtime for an ONNX source. Built once
    per run (the pipeline keeps it on the context): the race and the gate compare against this one."""
    source = ctx.source
    engine: dict[str, Any]
    if source.onnx_path is not None:
        engine = {"format": formats.ONNXRUNTIME, "file": source.onnx_path.name}
        root = source.onnx_path.parent
        return Subject("baseline", load_engine(root, engine, ctx.threads), engine, root, engine_bytes(root, engine))
    engine = {
        "format": formats.PYTORCH,
        "model_dir": source.location,
        "task": source.task,
        "pooling": ctx.pooling,
        "gguf_file": source.gguf_file,
        "allow_pickle": ctx.plan.model.allow_pickle,
    }
    # Tied weights (an LM head sharing the embedding) appear twice in a state dict: count storage once.
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in source.module.state_dict().values()}
    root = Path(source.location) if Path(source.location).exists() else Path(".")
    return Subject("baseline", task.baseline_runner(source.module, ctx), engine, root, sum(unique.values()))


def candidate(root: Path, engine: dict, runner: TensorRunner, layer_precision: dict | None = None) -> Subject:
    return Subject("candidate", runner, engine, root, engine_bytes(root, engine), layer_precision or {})
