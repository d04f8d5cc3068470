"""Tasks: what a kind of model takes and returns, its PyTorch baseline, and how it is evaluated.

A task is registered once by name (`model.task=NAME`). Stages and the pipeline ask the task for
what differs between, say, a sentence encoder and a causal LM; everything else is shared.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import numpy as np

from optimize.errors import RecipeError


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows (each sample flattened)."""
    a = a.astype(np.float64).reshape(len(a), -1)
    b = b.astype(np.float64).reshape(len(b), -1)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)


def fidelity(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], output: str | None) -> float:
    """Worst per-sample cosine over the deciding output (or over every output)."""
    names = [output] if output else list(reference)
    return float(min(cosine_rows(reference[n], candidate[n]).min() for n in names))


@dataclass
class Task:
    """Base task: any ONNX model, judged output by output on data or random inputs."""

    name: str = "generic"
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    dynamic_axes: dict = field(default_factory=dict)
    fidelity_output: str | None = None  # the output whose fidelity decides accuracy; None: all outputs

    def module(self, model, ctx):
        """The PyTorch module to export and to run as the baseline (forward takes input_names in order)."""
        raise RecipeError(f"model.task={self.name} has no PyTorch wrapper; give an ONNX source")

    def evaluate(self, baseline, candidate, ctx) -> tuple[dict, dict]:
        """Returns (metrics {baseline, candidate}, description of the evaluation data)."""
        from optimize import evaluate

        return evaluate.compare_runners(baseline, candidate, ctx, self.fidelity_output)


@dataclass
class SentenceEmbedding(Task):
    name: str = "sentence_embedding"
    input_names: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")
    output_names: tuple[str, ...] = ("last_hidden_state", "sentence_embedding")
    dynamic_axes: dict = field(default_factory=lambda: {
        n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask", "token_type_ids")})
    fidelity_output: str | None = "sentence_embedding"

    def module(self, model, ctx):
        from engines.pytorch_runner import read_pooling, sentence_embedding_module

        folder = ctx.source.tokenizer_dir
        pooling = read_pooling(Path(folder)) if folder else {"mode": "mean", "normalize": False}
        ctx.records["pooling"] = pooling
        return sentence_embedding_module(model, pooling)


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    _TASKS[task.name] = task
    return task


register_task(Task())
register_task(SentenceEmbedding())


def get(name: str) -> Task:
    from optimize.registry import load_plugins

    load_plugins()
    try:
        return _TASKS[name]
    except KeyError:
        raise RecipeError(f"model.task={name} is not supported (known: {', '.join(sorted(_TASKS))})") from None


def names() -> list[str]:
    from optimize.registry import load_plugins

    load_plugins()
    return sorted(_TASKS)

