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


def reference(source) -> dict:
    """What the baseline is, for the manifest and the report: the GGUF file dequantized (the user's
    quantized model, with its matrices' types), an ONNX file on ONNX Runtime, or a checkpoint in FP32."""
    if source.onnx_path is not None:
        return {"kind": "onnx", "statement": f"the ONNX file {source.onnx_path.name} on ONNX Runtime"}
    if source.gguf_file:
        types = gguf_matrix_types(Path(source.location) / source.gguf_file)
        listed = ", ".join(f"{kind} x{count}" for kind, count in types.items())
        return {
            "kind": "gguf",
            "gguf_types": types,
            "statement": f"the GGUF file {source.gguf_file} dequantized to FP32 (its matrices: {listed}), "
            "the user's quantized model",
        }
    first = next(iter(source.module.parameters()), None) if hasattr(source.module, "parameters") else None
    if first is not None and str(first.dtype) in ("torch.bfloat16", "torch.float16"):  # kept in its precision
        precision = str(first.dtype).removeprefix("torch.")
        return {
            "kind": "checkpoint",
            "statement": f"the checkpoint {source.location} in {precision} (PyTorch), scored in FP32 a module "
            f"at a time, generating in {precision}",
        }
    return {"kind": "checkpoint", "statement": f"the checkpoint {source.location} in FP32 (PyTorch)"}


def gguf_matrix_types(path: Path) -> dict[str, int]:
    """{GGUF tensor type: count} over the file's matrices, most first (norms and biases left out)."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if len(tensor.shape) >= 2:
            kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
