"""What each task feeds a model and reads back, so stages and evaluation agree on it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TaskSpec:
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dynamic_axes: dict
    fidelity_output: str | None  # the output whose fidelity decides accuracy; None: all outputs


SENTENCE_EMBEDDING = TaskSpec(
    input_names=("input_ids", "attention_mask", "token_type_ids"),
    output_names=("last_hidden_state", "sentence_embedding"),
    dynamic_axes={name: {0: "batch", 1: "sequence"} for name in ("input_ids", "attention_mask", "token_type_ids")},
    fidelity_output="sentence_embedding",
)

TASKS = {"sentence_embedding": SENTENCE_EMBEDDING}


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows (each sample flattened)."""
    a = a.astype(np.float64).reshape(len(a), -1)
    b = b.astype(np.float64).reshape(len(b), -1)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)


def fidelity(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], output: str | None) -> float:
    """Worst per-sample cosine over the deciding output (or over every output)."""
    names = [output] if output else list(reference)
    return float(min(cosine_rows(reference[n], candidate[n]).min() for n in names))
