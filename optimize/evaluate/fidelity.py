"""How close a candidate's outputs are to the baseline's: cosine per sample, retrieval agreement,
max abs error. Pure numpy on arrays both sides computed from the same inputs."""

from __future__ import annotations

import numpy as np

from engines.similarity import cosine_rows


def worst_cosine(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], output: str | None) -> float:
    """Worst per-sample cosine over the deciding output (or over every output)."""
    names = [output] if output else list(reference)
    return float(min(cosine_rows(reference[n], candidate[n]).min() for n in names))


def embedding_fidelity(base: np.ndarray, cand: np.ndarray, top_k: int) -> dict:
    cosine = cosine_rows(base, cand)
    return {
        "cosine_min": float(cosine.min()),
        "cosine_mean": float(cosine.mean()),
        "topk_agreement": topk_agreement(base, cand, top_k),
        "top_k": top_k,
        "max_abs_error": float(np.abs(base - cand).max()),
        "samples": int(len(base)),
    }


def topk_agreement(base: np.ndarray, cand: np.ndarray, k: int) -> float:
    """Mean overlap of each item's k nearest neighbours (cosine, itself excluded) under both models."""

    def neighbours(e):
        e = e / np.linalg.norm(e, axis=1, keepdims=True)
        sim = e @ e.T
        np.fill_diagonal(sim, -np.inf)
        return np.argsort(-sim, axis=1)[:, :k]

    k = min(k, len(base) - 1)
    nb, nc = neighbours(base), neighbours(cand)
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(nb, nc)]))


def output_fidelity(base: dict[str, np.ndarray], cand: dict[str, np.ndarray]) -> dict:
    """Every output compared: per-output min cosine and max abs error, plus the worst of each."""
    per_output = {}
    for name in base:
        per_output[name] = {
            "cosine_min": float(cosine_rows(base[name], cand[name]).min()),
            "max_abs_error": float(np.abs(base[name] - cand[name]).max()),
        }
    return {
        "cosine_min": min(o["cosine_min"] for o in per_output.values()),
        "max_abs_error": max(o["max_abs_error"] for o in per_output.values()),
        "outputs": per_output,
        "samples": int(len(next(iter(base.values())))),
    }


def mask_agreement(base: np.ndarray, cand: np.ndarray, threshold: float) -> dict:
    """Segmentation/detection maps binarized at `threshold` on both sides, against the baseline's.

    `iou` is pooled over the whole evaluation set (intersection over union of every pixel, as
    segmentation benchmarks accumulate it): a per-sample mean lets samples where both masks are
    empty count as perfect, so four images of which one holds text read 0.82 when the one with text
    scored 0.28, and one stray pixel on an empty image moves the mean by a quarter. It is None when
    the baseline finds nothing above the threshold anywhere: then IoU measures nothing and a gate on
    it must not pass. The per-sample mean and min stay in the report for diagnosis."""
    a = base.reshape(len(base), -1) > threshold
    b = cand.reshape(len(cand), -1) > threshold
    intersection, union = (a & b).sum(1), (a | b).sum(1)
    per_sample = np.where(union > 0, intersection / np.maximum(union, 1), 1.0)
    positive = int(a.sum())
    return {
        "threshold": threshold,
        "iou": float(intersection.sum() / union.sum()) if positive else None,
        "iou_mean": float(per_sample.mean()),
        "iou_min": float(per_sample.min()),
        "pixel_agreement": float((a == b).mean()),
        "positive_pixels": positive,
        "positive_share": float(a.mean()),  # how much of the baseline's map is above the threshold
    }
