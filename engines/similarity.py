"""Cosine similarity of matching output rows: the gate's fidelity measure (optimize/evaluate/fidelity.py)
and the shadow's on live traffic (serve/shadow/traffic.py), one function so the two cannot drift.
Pure numpy; neither the pipeline nor a runtime."""

from __future__ import annotations

import numpy as np

EMPTY_ROW = 1e-4  # a row this small relative to the largest row of the batch holds nothing


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows (each sample flattened)."""
    a = a.astype(np.float64).reshape(len(a), -1)
    b = b.astype(np.float64).reshape(len(b), -1)
    norm_a, norm_b = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cosine = (a * b).sum(1) / np.maximum(norm_a * norm_b, 1e-30)
    # Two rows that are both empty next to the others (a detector's map of an image without text:
    # zeros and sigmoid underflow, 1e-4 of the strongest row or less) are the same output, cosine 1;
    # their direction is rounding noise. Rows of embeddings or logits are never that small.
    empty = EMPTY_ROW * max(float(norm_a.max(initial=0.0)), float(norm_b.max(initial=0.0)))
    return np.where((norm_a <= empty) & (norm_b <= empty), 1.0, cosine)
