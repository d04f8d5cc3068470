"""What the two text classifier tasks share (text_classification and token_classification): the
Hugging Face classifier wrapped to return its logits, the hard check of the model's id2label against
the evaluation data's labels, the labels file the artifact ships for serving, and the judging of
baseline and candidate on labeled data (optimize/evaluate/labeled.py computes the figures).

A model whose labels do not match the data's is refused before any stage runs, with one line: a
model's id2label that shares no name with the data (or is the LABEL_0.. default while the data
names its classes), labels the model does not know, and an evaluation set of one class (whose
accuracy cannot tell a classifier from a constant) each exit 2.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from optimize.errors import RecipeError
from optimize.tasks.base import Task

if TYPE_CHECKING:
    from calibration import TextSet
    from optimize.context import Context

LABELS_FILE = "labels.json"
ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def id2label_of(module) -> dict[int, str]:
    config = getattr(module, "config", None)
    mapping = getattr(config, "id2label", None) or {}
    return {int(k): str(v) for k, v in mapping.items()}


def label_ids(id2label: dict[int, str], labels: list, key: str = "evaluate.data") -> np.ndarray:
    """The data's labels (names or integer ids) as the model's ids, or one RecipeError naming the problem."""
    if not id2label:
        raise RecipeError("the model's config.json has no id2label: it is not a classifier with named labels")
    kinds = {type(v) for v in labels}
    if kinds - {int, str} or len(kinds) > 1:
        raise RecipeError(f"{key} mixes label names and ids ({', '.join(sorted(k.__name__ for k in kinds))})")
    if kinds == {int}:
        unknown = sorted(set(labels) - set(id2label))
        if unknown:
            raise RecipeError(
                f"{key} has label ids the model does not have: {_few(unknown)} (the model's ids: 0..{max(id2label)})"
            )
        return np.asarray(labels, dtype=np.int64)
    label2id = {name: i for i, name in id2label.items()}
    found = sorted(set(labels))
    unknown = [name for name in found if name not in label2id]
    if len(unknown) == len(found):
        default = all(name == f"LABEL_{i}" for i, name in id2label.items())
        raise RecipeError(
            f"the model's id2label ({_few(list(id2label.values()))}) does not match {key}'s labels ({_few(found)})"
            + ("; the model has the default LABEL_i names: set id2label in its config.json" if default else "")
        )
    if unknown:
        raise RecipeError(
            f"{key} has labels the model does not know: {_few(unknown)} (the model's id2label: "
            f"{_few(list(id2label.values()))})"
        )
    return np.array([label2id[name] for name in labels], dtype=np.int64)


def require_classes(ids: np.ndarray, id2label: dict[int, str], key: str = "evaluate.data", what: str = "class") -> None:
    present = sorted(set(ids.tolist()))
    if len(present) < 2:
        name = id2label.get(present[0], present[0]) if present else "none"
        raise RecipeError(
            f"{key} holds one {what} ({name}): accuracy on it cannot tell a classifier from a constant; "
            f"give examples of at least two"
        )


def _few(values: list, limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


@dataclass
class LabeledTextTask(Task, abc.ABC):
    """A Hugging Face classifier over token ids: baseline PyTorch FP32 logits, judged on labeled data."""

    input_names: tuple[str, ...] = ENCODER_INPUTS
    output_names: tuple[str, ...] = ("logits",)
    dynamic_axes: dict = field(default_factory=lambda: {n: {0: "batch", 1: "sequence"} for n in ENCODER_INPUTS})
    fidelity_output: str | None = None  # logits are compared output by output (cosine, max abs error)
    distill_loss: str | None = "class_logits"

    def module(self, model, ctx: Context):
        from engines.pytorch.runner import logits_module

        return logits_module(model)

    # --- before any stage: the model's labels against the data's -------------------------------------

    def check_source(self, ctx: Context) -> None:
        if ctx.plan.evaluate.inputs != "data":
            raise RecipeError(f"{self.name} is judged on labeled data: set evaluate.inputs=data")
        if ctx.loaded_source().module is None:
            raise RecipeError(
                f"model.task={self.name} needs a Hugging Face model folder or hub id (an ONNX file has no id2label)"
            )
        self.labels_of(ctx.evaluation_data())
        self.gold_ids(ctx)  # every refusal here, before minutes of export and quantization

    def labels_of(self, data: TextSet) -> list:
        """The evaluation set's labels; a set without them is refused with the key to set."""
        if data.labels is None:
            raise RecipeError(
                f"evaluate.data.source={data.source} has no labels; {self.name} needs a labeled source "
                "(evaluate.data.source=labeled with a path, field and label_field)"
            )
        return data.labels

    def files(self, ctx: Context) -> dict[str, Path]:
        """labels.json in the artifact: what serve names its predictions with."""
        path = ctx.scratch / LABELS_FILE
        mapping = id2label_of(ctx.loaded_source().module)
        path.write_text(json.dumps({"task": self.name, "id2label": {str(k): v for k, v in mapping.items()}}, indent=2))
        return {LABELS_FILE: path}

    def thresholds(self, ctx: Context) -> dict:
        return dict(ctx.plan.gate)

    # --- judging ----------------------------------------------------------------------------------------

    def evaluate(self, baseline, candidate, ctx: Context) -> tuple[dict, dict]:
        """Labeled accuracy of both on the evaluation set, the drops with their paired bootstrap
        intervals, agreement with the baseline, logit fidelity, and the shared size/latency/memory."""
        from optimize.evaluate import fidelity, harness

        data = ctx.evaluation_data()
        inputs = ctx.encode(data.items)
        cfg = ctx.plan.evaluate
        batch_sizes = ctx.plan.workload.batch_sizes_timed(list(cfg.batch_sizes))
        metrics = harness.shared_metrics(baseline, candidate, inputs, cfg, ctx.scratch, batch_sizes)
        batches = harness.batches_of(inputs, harness.FIDELITY_BATCH)
        base, cand = harness.run_all(baseline.runner, batches), harness.run_all(candidate.runner, batches)
        compared = self.compare(base["logits"], cand["logits"], ctx)
        metrics["baseline"].update(compared["baseline"])
        metrics["candidate"].update(compared["candidate"], labeled=compared["labeled"])
        metrics["candidate"]["fidelity"] = fidelity.output_fidelity(
            {"logits": base["logits"]}, {"logits": cand["logits"]}
        )
        metrics["table"] = report_rows(metrics["baseline"], metrics["candidate"])
        id2label = id2label_of(ctx.loaded_source().module)
        present = sorted(set(self.gold_ids(ctx).tolist()))
        return metrics, dict(data.describe(), labels=[id2label[i] for i in present])

    def race_scores(self, reference: dict, outputs: dict, ctx: Context) -> dict:
        """What the race's accuracy checks read of one candidate: the same figures as the final evaluation."""
        compared = self.compare(reference["logits"], outputs["logits"], ctx)
        return dict(compared["candidate"], labeled=compared["labeled"])

    @abc.abstractmethod
    def compare(self, base_logits: np.ndarray, cand_logits: np.ndarray, ctx: Context) -> dict:
        """The labeled figures of both sides and the candidate's drops (the subclass's metrics)."""

    @abc.abstractmethod
    def gold_ids(self, ctx: Context) -> np.ndarray:
        """The evaluation labels as the model's ids (NER: every word's tag, sentence after sentence),
        checked against the model's id2label."""


def report_rows(base: dict, cand: dict) -> list[list[str]]:
    """The report's rows of labeled figures: each score, each drop with its interval, agreement."""
    labeled = cand["labeled"]
    rows = []
    for key, label in (
        ("accuracy", "accuracy"),
        ("macro_f1", "macro-F1"),
        ("mcc", "MCC"),
        ("entity_f1", "entity F1 (seqeval)"),
    ):
        if key in cand:
            rows.append([f"{label} ({labeled['examples']} examples)", f"{base[key]:.4f}", f"{cand[key]:.4f}", ""])
    for key, label in (("accuracy_drop_points", "accuracy drop, points"), ("f1_drop_points", "F1 drop, points")):
        interval = labeled["bootstrap"][key]
        rows.append(
            [
                f"{label} ({interval['level']:.0%} paired bootstrap)",
                "",
                f"{cand[key]:.2f}",
                f"[{interval['low']:.2f}, {interval['high']:.2f}]",
            ]
        )
        if labeled["resolution"][key]["resolves_threshold"] is False:  # the gate check's note says why
            rows.append(["  (the set is too small to resolve this threshold)", "", "", ""])
    rows.append(["predictions equal to the baseline's", "", f"{cand['prediction_agreement']:.4f}", ""])
    return rows
