"""Labeled metrics against values computed by hand, the paired bootstrap, the resolution notes, and
the label checks a classifier run makes before any stage (one RecipeError each)."""

from __future__ import annotations

import numpy as np
import pytest

from optimize.errors import RecipeError
from optimize.evaluate import labeled
from optimize.tasks.labeled_text import label_ids, require_classes


def test_classification_scores_by_hand():
    # Confusion (rows gold, columns predicted) over classes 0, 1, 2:
    #   [[2, 1, 0],
    #    [0, 2, 0],
    #    [0, 1, 2]]   -> 6 of 8 right
    gold = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    pred = np.array([0, 0, 1, 1, 1, 2, 2, 1])
    scores = labeled.classification_scores(gold, pred)
    assert scores["accuracy"] == pytest.approx(6 / 8)
    # F1 per class: 0: p=1, r=2/3 -> 0.8; 1: p=2/4, r=1 -> 2/3; 2: p=1, r=2/3 -> 0.8
    assert scores["macro_f1"] == pytest.approx((0.8 + 2 / 3 + 0.8) / 3)
    # MCC from the confusion: c=6, s=8, t=(3,2,3), p=(2,4,2)
    c, s, t, p = 6, 8, np.array([3, 2, 3]), np.array([2, 4, 2])
    mcc = (c * s - t @ p) / np.sqrt((s**2 - p @ p) * (s**2 - t @ t))
    assert scores["mcc"] == pytest.approx(mcc)
    assert labeled.macro_f1(gold, pred, 3) == pytest.approx(scores["macro_f1"])  # the bootstrap's own
    assert labeled.macro_f1(gold, pred, 5) == pytest.approx(scores["macro_f1"])  # absent classes do not count


def test_entity_f1_is_seqeval_f1_by_hand():
    from seqeval.metrics import f1_score

    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG", "I-ORG"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["O", "B-ORG", "O"]]
    # gold entities: PER(0-1), LOC(3), ORG(1-2); predicted: PER(0-1), ORG(1) -> one right of 2 / 3
    counts = labeled.entity_counts(gold, pred)
    assert counts.f1() == pytest.approx(2 * 1 / (2 + 3))
    assert counts.f1() == pytest.approx(f1_score(gold, pred))
    assert counts.f1(np.array([0])) == pytest.approx(2 * 1 / (1 + 2))  # first sentence alone


def test_paired_bootstrap_of_the_accuracy_drop():
    gold = np.zeros(200, dtype=int)
    base = gold.copy()
    same = labeled.accuracy_drop_interval(base == gold, base == gold)
    assert same["low"] == same["high"] == 0.0  # identical predictions: no drop in any resample
    cand = base.copy()
    cand[:4] = 1  # the candidate is wrong on 4 of 200: 2 points worse
    interval = labeled.accuracy_drop_interval(base == gold, cand == gold)
    assert 0.0 <= interval["low"] < 2.0 < interval["high"] <= 6.0
    assert labeled.accuracy_drop_interval(base == gold, cand == gold) == interval  # seeded
    # Paired: a candidate wrong where the baseline is wrong too has no drop, whatever the draw.
    both = labeled.accuracy_drop_interval(cand == gold, cand == gold)
    assert both["low"] == both["high"] == 0.0


def test_resolution_says_when_the_set_is_too_small():
    gold = np.array([0, 1] * 50)
    base = gold.copy()
    cand = gold.copy()
    cand[0] = 1
    compared = labeled.compare_classifiers(gold, base, cand, {"max_accuracy_drop": 0.5})
    assert compared["candidate"]["accuracy_drop_points"] == pytest.approx(1.0)
    assert compared["candidate"]["prediction_agreement"] == pytest.approx(0.99)
    note = compared["labeled"]["resolution"]["accuracy_drop_points"]
    assert note["resolves_threshold"] is False and "one example moves accuracy by 1.00 points" in note["note"]
    # 2,000 identical predictions resolve a half-point threshold: the interval is [0, 0].
    big = np.array([0, 1] * 1000)
    resolved = labeled.compare_classifiers(big, big, big, {"max_accuracy_drop": 0.5})
    assert resolved["labeled"]["resolution"]["accuracy_drop_points"]["resolves_threshold"] is True


def test_gate_notes_carry_the_interval():
    from optimize import gate

    gold = np.array([0, 1] * 100)
    cand = gold.copy()
    cand[:2] = 1 - cand[:2]
    compared = labeled.compare_classifiers(gold, gold, cand, {"max_accuracy_drop": 0.5})
    verdict = gate.judge(
        compared["baseline"],
        dict(compared["candidate"], labeled=compared["labeled"]),
        {"max_accuracy_drop": 1.5, "max_f1_drop": 0.5, "min_prediction_agreement": 0.995},
    )
    checks = {c.name: c for c in verdict.checks}
    assert checks["max_accuracy_drop"].passed and checks["max_accuracy_drop"].value == pytest.approx(1.0)
    assert "paired bootstrap interval" in checks["max_accuracy_drop"].note
    assert not checks["max_f1_drop"].passed
    assert not checks["min_prediction_agreement"].passed and checks["min_prediction_agreement"].value == 0.99


ID2LABEL = {0: "negative", 1: "positive"}


def test_label_names_and_ids_map_to_the_models_ids():
    assert label_ids(ID2LABEL, ["positive", "negative", "positive"]).tolist() == [1, 0, 1]
    assert label_ids(ID2LABEL, [1, 0]).tolist() == [1, 0]


@pytest.mark.parametrize(
    "labels, fragment",
    [
        (["pos", "neg"], "does not match"),
        (["positive", "neutral"], "labels the model does not know: neutral"),
        ([0, 2], "label ids the model does not have: 2"),
        (["positive", 1], "mixes label names and ids"),
    ],
)
def test_label_refusals(labels, fragment):
    with pytest.raises(RecipeError, match=fragment):
        label_ids(ID2LABEL, labels)


def test_default_label_names_are_named_in_the_refusal():
    with pytest.raises(RecipeError, match="default LABEL_i names"):
        label_ids({0: "LABEL_0", 1: "LABEL_1"}, ["negative", "positive"])


def test_one_class_is_refused():
    with pytest.raises(RecipeError, match=r"holds one class \(positive\)"):
        require_classes(np.array([1, 1, 1]), ID2LABEL)
