"""Fidelity of map outputs (segmentation, text detection): mask IoU and pixel agreement against the
baseline, the gate keys that read them, and cosine on rows that hold nothing."""

from __future__ import annotations

import numpy as np
import pytest

from engines.similarity import cosine_rows
from optimize import gate
from optimize.errors import RecipeError
from optimize.evaluate.fidelity import mask_agreement
from optimize.evaluate.harness import chosen_outputs, mask_metrics


def test_mask_iou_and_pixel_agreement():
    base = np.zeros((3, 1, 4, 4), np.float32)
    cand = base.copy()
    base[0, 0, :2, :2] = 0.9  # 4 text pixels
    cand[0, 0, :2, :1] = 0.8  # 2 of them found
    cand[1, 0, 3, 3] = 0.7  # a false positive on an image without text
    result = mask_agreement(base, cand, 0.5)
    assert result["iou_min"] == 0.0  # sample 1: nothing vs one pixel
    assert result["iou_mean"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)  # sample 2: both empty, full agreement
    # Pooled over the set: 2 pixels found of the 5 either side marks; the empty sample adds nothing.
    assert result["iou"] == pytest.approx(2 / 5)
    assert result["pixel_agreement"] == pytest.approx(1 - 3 / 48)
    assert result["positive_share"] == pytest.approx(4 / 48) and result["positive_pixels"] == 4


def test_mask_iou_is_not_measured_when_the_baseline_finds_nothing():
    """Images without text: every per-sample IoU is 1 (both empty) or 0 (a stray pixel), and neither
    says anything about text; the gate on IoU fails as not measured instead of passing."""
    base = np.zeros((4, 1, 8, 8), np.float32)
    cand = base.copy()
    cand[3, 0, 0, 0] = 0.9
    result = mask_agreement(base, cand, 0.5)
    assert result["iou"] is None and result["positive_pixels"] == 0 and result["iou_mean"] == 0.75
    verdict = gate.judge({}, {"fidelity": {"mask": result}}, {"min_mask_iou": 0.5})
    assert not verdict.passed and verdict.checks[0].note == "not measured"


def test_empty_rows_have_cosine_one_and_a_false_positive_has_zero():
    base = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [1e-9, 0.0, 0.0], [0.0, 0.0, 0.0]])
    cand = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 1e-9, 0.0], [0.0, 2.0, 0.0]])
    assert cosine_rows(base, cand).tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0])
    # Alone in a batch, tiny rows are compared as they are: nothing larger makes them empty.
    assert cosine_rows(base[2:3], cand[2:3])[0] == pytest.approx(0.0)


def test_mask_gate_keys_and_recipe_errors():
    candidate = {"fidelity": {"mask": {"iou": 0.85, "pixel_agreement": 0.999}}}
    verdict = gate.judge({}, candidate, {"min_mask_iou": 0.9, "min_mask_agreement": 0.99})
    checks = {c.name: c.passed for c in verdict.checks}
    assert checks == {"min_mask_iou": False, "min_mask_agreement": True} and not verdict.passed
    outputs = {"map": np.zeros((1, 4)), "state": np.zeros((1, 2))}
    assert mask_metrics(outputs, outputs, {}) is None
    with pytest.raises(RecipeError, match=r"mask_output=nope: the model's outputs are \['map', 'state'\]"):
        mask_metrics(outputs, outputs, {"mask_output": "nope"})
    assert chosen_outputs(outputs, None) == ["map", "state"] and chosen_outputs(outputs, ["map"]) == ["map"]
    with pytest.raises(RecipeError, match=r"outputs names \['probability'\]"):
        chosen_outputs(outputs, ["probability"])
