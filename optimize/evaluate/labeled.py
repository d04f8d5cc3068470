"""Labeled accuracy of a classifier against its baseline, computed here (nothing fetched):
accuracy, macro-F1 and MCC (scikit-learn), entity-level F1 for NER (seqeval's definition: an entity
counts when its type and its whole span match, IOB2 chunks read by seqeval.metrics.sequence_labeling
.get_entities), a paired bootstrap interval of each drop, and agreement with the baseline's predictions.

The bootstrap is paired: each resample draws the same examples for the baseline and the candidate,
so the interval is that of the drop itself, not of two accuracies that each vary with the draw. A set
is too small to resolve a threshold when one example moves the metric by more than the threshold, or
when the interval of the drop holds the threshold (more examples would narrow it to one side).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 1000
LEVEL = 0.95


def classification_scores(labels: np.ndarray, predicted: np.ndarray) -> dict:
    """Accuracy, macro-F1 (over the classes in labels or predictions) and Matthews correlation."""
    from sklearn.metrics import f1_score, matthews_corrcoef

    return {
        "accuracy": float(np.mean(labels == predicted)),
        "macro_f1": float(f1_score(labels, predicted, average="macro", zero_division=0)),
        "mcc": float(matthews_corrcoef(labels, predicted)),
    }


@dataclass
class EntityCounts:
    """Per sentence: entities both agree on (true positives), predicted entities, gold entities."""

    true_positive: np.ndarray
    predicted: np.ndarray
    gold: np.ndarray

    def f1(self, rows: np.ndarray | None = None) -> float:
        """seqeval's micro F1 over the sentences `rows` (default all): 2TP / (predicted + gold)."""
        take = slice(None) if rows is None else rows
        tp, pred, gold = self.true_positive[take].sum(), self.predicted[take].sum(), self.gold[take].sum()
        return float(2 * tp / (pred + gold)) if pred + gold else 0.0


def entity_counts(gold_tags: list[list[str]], predicted_tags: list[list[str]]) -> EntityCounts:
    """Entities per sentence with seqeval's chunking (type, start, end), so the F1 is seqeval's."""
    from seqeval.metrics.sequence_labeling import get_entities

    tp, pred, gold = [], [], []
    for g, p in zip(gold_tags, predicted_tags):
        gold_set, pred_set = set(get_entities(list(g))), set(get_entities(list(p)))
        tp.append(len(gold_set & pred_set))
        pred.append(len(pred_set))
        gold.append(len(gold_set))
    return EntityCounts(np.array(tp), np.array(pred), np.array(gold))


def paired_bootstrap(statistic, n: int, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> dict:
    """Percentile interval of statistic(rows) over `resamples` draws of n rows with replacement."""
    rng = np.random.default_rng(seed)
    values = np.array([statistic(rng.integers(0, n, n)) for _ in range(resamples)])
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return {"low": float(low), "high": float(high), "level": level, "resamples": resamples, "seed": seed}


def accuracy_drop_interval(base_correct: np.ndarray, cand_correct: np.ndarray, **kw) -> dict:
    """Interval of 100 * (baseline accuracy - candidate accuracy) on the same resampled examples."""
    diff = base_correct.astype(np.float64) - cand_correct.astype(np.float64)
    return paired_bootstrap(lambda rows: 100 * diff[rows].mean(), len(diff), **kw)


def macro_f1(labels: np.ndarray, predicted: np.ndarray, classes: int) -> float:
    """scikit-learn's macro-F1 (zero_division=0) from the confusion counts, over the classes that
    occur in labels or predictions: bincount instead of f1_score, so 1,000 resamples take
    milliseconds (the tests hold it equal to scikit-learn's)."""
    confusion = np.bincount(labels * classes + predicted, minlength=classes * classes).reshape(classes, classes)
    true_positive = np.diag(confusion).astype(np.float64)
    gold, pred = confusion.sum(1), confusion.sum(0)
    present = (gold + pred) > 0
    f1 = np.divide(2 * true_positive, gold + pred, out=np.zeros_like(true_positive), where=present)
    return float(f1[present].mean())


def macro_f1_drop_interval(labels: np.ndarray, base: np.ndarray, cand: np.ndarray, **kw) -> dict:
    classes = int(max(labels.max(), base.max(), cand.max())) + 1

    def drop(rows):
        return 100 * (macro_f1(labels[rows], base[rows], classes) - macro_f1(labels[rows], cand[rows], classes))

    return paired_bootstrap(drop, len(labels), **kw)


def entity_f1_drop_interval(base: EntityCounts, cand: EntityCounts, **kw) -> dict:
    return paired_bootstrap(lambda rows: 100 * (base.f1(rows) - cand.f1(rows)), len(base.gold), **kw)


def resolution(drop: float, interval: dict, examples: int, threshold: float | None, metric: str) -> dict:
    """Whether this set can tell a drop of `threshold` points from none, and why not."""
    step = 100 / examples
    record = {"one_example_points": step, "threshold": threshold, "resolves_threshold": None, "note": ""}
    if threshold is None:
        return record
    reasons = []
    if step > threshold:
        reasons.append(f"one example moves {metric} by {step:.2f} points, more than the {threshold} allowed")
    if interval["low"] <= threshold <= interval["high"]:
        reasons.append(
            f"the {interval['level']:.0%} interval of the drop [{interval['low']:.2f}, {interval['high']:.2f}] "
            f"holds the threshold {threshold}, so the set cannot tell whether the drop is within it"
        )
    record["resolves_threshold"] = not reasons
    if reasons:
        record["note"] = f"the evaluation set ({examples} examples) is too small to resolve the threshold: " + (
            "; ".join(reasons)
        )
    return record


def compare_classifiers(labels: np.ndarray, base_pred: np.ndarray, cand_pred: np.ndarray, thresholds: dict) -> dict:
    """Sequence classification: both sides' scores, the drops in points with their intervals, the
    share of examples where the candidate predicts what the baseline predicts."""
    base, cand = classification_scores(labels, base_pred), classification_scores(labels, cand_pred)
    accuracy_drop = 100 * (base["accuracy"] - cand["accuracy"])
    f1_drop = 100 * (base["macro_f1"] - cand["macro_f1"])
    accuracy_ci = accuracy_drop_interval(base_pred == labels, cand_pred == labels)
    f1_ci = macro_f1_drop_interval(labels, base_pred, cand_pred)
    return {
        "baseline": base,
        "candidate": dict(
            cand,
            accuracy_drop_points=accuracy_drop,
            f1_drop_points=f1_drop,
            prediction_agreement=float(np.mean(base_pred == cand_pred)),
        ),
        "labeled": {
            "examples": int(len(labels)),
            "f1": "macro-F1 over the classes",
            "bootstrap": {"accuracy_drop_points": accuracy_ci, "f1_drop_points": f1_ci},
            "resolution": {
                "accuracy_drop_points": resolution(
                    accuracy_drop, accuracy_ci, len(labels), thresholds.get("max_accuracy_drop"), "accuracy"
                ),
                "f1_drop_points": resolution(f1_drop, f1_ci, len(labels), thresholds.get("max_f1_drop"), "macro-F1"),
            },
        },
    }


def compare_taggers(gold: list[list[str]], base_tags: list[list[str]], cand_tags: list[list[str]], thresholds) -> dict:
    """NER: entity-level F1 (seqeval's), word accuracy, the drops with paired intervals over sentences,
    and word-level agreement with the baseline's tags."""
    flat = lambda rows: np.array([t for row in rows for t in row])  # noqa: E731
    g, b, c = flat(gold), flat(base_tags), flat(cand_tags)
    base_counts, cand_counts = entity_counts(gold, base_tags), entity_counts(gold, cand_tags)
    base = {"entity_f1": base_counts.f1(), "accuracy": float(np.mean(g == b))}
    cand = {"entity_f1": cand_counts.f1(), "accuracy": float(np.mean(g == c))}
    f1_drop = 100 * (base["entity_f1"] - cand["entity_f1"])
    accuracy_drop = 100 * (base["accuracy"] - cand["accuracy"])
    f1_ci = entity_f1_drop_interval(base_counts, cand_counts)
    # Word accuracy resampled by sentence (words of one sentence are not independent draws).
    per_sentence = [
        (np.array(x) == np.array(y), np.array(x) == np.array(z)) for x, y, z in zip(gold, base_tags, cand_tags)
    ]
    base_hits = np.array([h.sum() for h, _ in per_sentence])
    cand_hits = np.array([h.sum() for _, h in per_sentence])
    words = np.array([len(h) for h, _ in per_sentence])
    accuracy_ci = paired_bootstrap(
        lambda rows: 100 * (base_hits[rows].sum() - cand_hits[rows].sum()) / max(words[rows].sum(), 1), len(words)
    )
    sentences = len(gold)
    return {
        "baseline": base,
        "candidate": dict(
            cand,
            accuracy_drop_points=accuracy_drop,
            f1_drop_points=f1_drop,
            prediction_agreement=float(np.mean(b == c)),
        ),
        "labeled": {
            "examples": sentences,
            "words": int(words.sum()),
            "f1": "entity-level F1 (seqeval's definition, micro over entities)",
            "bootstrap": {"accuracy_drop_points": accuracy_ci, "f1_drop_points": f1_ci},
            "resolution": {
                "accuracy_drop_points": resolution(
                    accuracy_drop, accuracy_ci, int(words.sum()), thresholds.get("max_accuracy_drop"), "word accuracy"
                ),
                "f1_drop_points": resolution(f1_drop, f1_ci, sentences, thresholds.get("max_f1_drop"), "entity F1"),
            },
        },
    }


def interval_note(candidate: dict, key: str) -> str:
    """The gate's note on a drop check: its interval, and when the set cannot resolve the threshold."""
    labeled = candidate.get("labeled") or {}
    interval = (labeled.get("bootstrap") or {}).get(key)
    if not interval:
        return ""
    note = f"{interval['level']:.0%} paired bootstrap interval [{interval['low']:.2f}, {interval['high']:.2f}]"
    unresolved = ((labeled.get("resolution") or {}).get(key) or {}).get("note")
    return f"{note}; {unresolved}" if unresolved else note
