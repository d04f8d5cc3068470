"""Text and token classifiers through the command line: tiny BERT classifiers trained for seconds
(tests/support/tiny_classifiers.py), INT8 through the pipeline and the race, gated on labeled
accuracy; and the refusals a user with mismatched labels meets (exit 2, one line, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import tiny_classifiers
from tests.support.cli import one_error_line, run_optimize

pytest.importorskip("seqeval")
pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("text_classifier")
    model = tiny_classifiers.tiny_text_classifier(folder / "model")
    data = tiny_classifiers.write_jsonl(tiny_classifiers.topic_examples(), folder / "topics.jsonl")
    return model, data


@pytest.fixture(scope="module")
def ner_setup(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("token_classifier")
    model = tiny_classifiers.tiny_token_classifier(folder / "model")
    data = tiny_classifiers.write_jsonl(tiny_classifiers.ner_examples(), folder / "ner.jsonl")
    return model, data


def text_overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.source={model}",
        "model.task=text_classification",
        "engine=onnx",
        "quantize=ort_int8_dynamic",
        "quantize.params.fallback_min_cosine=null",
        "evaluate.data.source=labeled",
        f"evaluate.data.path={data}",
        "evaluate.data.count=100",
        "evaluate.data.min_chars=1",
        "calibration.source=labeled",
        f"calibration.path={data}",
        "calibration.count=16",
        "calibration.min_chars=1",
        "evaluate.latency=false",
        "evaluate.memory=false",
        "gate=none",
        "gate.max_accuracy_drop=3",
        "gate.max_f1_drop=5",
        "gate.min_prediction_agreement=0.9",
        f"output_dir={out}",
        f"hydra.run.dir={out.parent / 'run'}",
        *extra,
    ]


def test_text_classifier_int8_is_gated_on_labeled_accuracy(text_setup, tmp_path):
    model, data = text_setup
    out = tmp_path / "artifact"
    proc = run_optimize(*text_overrides(model, data, out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    base, cand = manifest["metrics"]["baseline"], manifest["metrics"]["candidate"]
    assert base["accuracy"] > 0.8  # the tiny model learned its topics
    assert cand["accuracy_drop_points"] == pytest.approx(100 * (base["accuracy"] - cand["accuracy"]))
    interval = cand["labeled"]["bootstrap"]["accuracy_drop_points"]
    assert interval["low"] <= cand["accuracy_drop_points"] <= interval["high"]
    assert {c["name"] for c in manifest["gate"]["checks"]} == {
        "max_accuracy_drop",
        "max_f1_drop",
        "min_prediction_agreement",
    }
    assert manifest["evaluation"]["labels"] == list(tiny_classifiers.TOPIC_LABELS)
    labels = json.loads((out / "labels.json").read_text())
    assert labels["id2label"] == {"0": "control_flow", "1": "data_model"}
    report = (out / "report.md").read_text()
    assert "paired bootstrap" in report and "macro-F1" in report
    check_bundle(out, tmp_path / "bundle")


def check_bundle(artifact: Path, bundle: Path) -> None:
    """The artifact as an edge bundle: run.py prints each text's labels and scores, highest first."""
    import subprocess
    import sys

    from tests.support.cli import ROOT

    exported = subprocess.run(
        [sys.executable, "-m", "optimize.export", str(artifact), "--bundle", str(bundle)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (bundle / "labels.json").is_file()
    texts = ["The while statement is used for repeated execution.", "Special method names of classes."]
    ran = subprocess.run([sys.executable, str(bundle / "run.py"), *texts], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    rows = [json.loads(line) for line in ran.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert sorted(p["label"] for p in row) == sorted(tiny_classifiers.TOPIC_LABELS)
        assert sum(p["score"] for p in row) == pytest.approx(1.0) and row[0]["score"] >= row[1]["score"]


def test_token_classifier_int8_is_gated_on_entity_f1(ner_setup, tmp_path):
    model, data = ner_setup
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={model}",
        "model.task=token_classification",
        "engine=onnx",
        "quantize=ort_int8_dynamic",
        "quantize.params.fallback_min_cosine=null",
        "evaluate.data.source=labeled",
        f"evaluate.data.path={data}",
        "evaluate.data.field=tokens",
        "evaluate.data.label_field=tags",
        "evaluate.data.count=30",
        "calibration.source=cpython_docs",  # plain text calibrates a token classifier too
        "calibration.count=16",
        "evaluate.latency=false",
        "evaluate.memory=false",
        "gate=none",
        "gate.max_f1_drop=5",
        "gate.max_accuracy_drop=2",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    base, cand = manifest["metrics"]["baseline"], manifest["metrics"]["candidate"]
    assert base["entity_f1"] > 0.5 and "entity_f1" in cand
    assert cand["f1_drop_points"] == pytest.approx(100 * (base["entity_f1"] - cand["entity_f1"]))
    assert cand["labeled"]["words"] > cand["labeled"]["examples"] == 30
    assert manifest["verdict"] == "passed"


def test_the_race_scores_each_candidate_on_labeled_accuracy(text_setup, tmp_path):
    model, data = text_setup
    out = tmp_path / "artifact"
    single_engine = ("engine=", "quantize")  # the race builds its own quantized candidates
    overrides = [
        o for o in text_overrides(model, data, out, "evaluate.data.count=64") if not o.startswith(single_engine)
    ]
    proc = run_optimize(
        *overrides,
        "engine=auto",
        "engine.params.candidates=[ort_fp32,ort_int8_dynamic_all]",
        "engine.params.timing_repeats=3",
        "engine.params.cache=false",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    race = json.loads((out / "manifest.json").read_text())["stages"]["engine"]
    for candidate in race["candidates"]:
        assert "accuracy_drop_points" in candidate["scores"]
        assert {c["name"] for c in candidate["accuracy_checks"]} >= {"max_accuracy_drop", "min_prediction_agreement"}


def write_rows(path: Path, rows: list[dict]) -> Path:
    return tiny_classifiers.write_jsonl(rows, path)


@pytest.mark.parametrize(
    "labels, fragment",
    [
        (("positive", "negative"), "does not match evaluate.data's labels (negative, positive)"),
        (("control_flow", "data_model", "errors"), "labels the model does not know: errors"),
        (("data_model",), "holds one class (data_model)"),
    ],
)
def test_label_mismatches_exit_2_with_one_line(text_setup, tmp_path, labels, fragment):
    model, data = text_setup
    rows = tiny_classifiers.topic_examples()
    relabeled = [dict(r, label=labels[i % len(labels)]) for i, r in enumerate(rows)]
    bad = write_rows(tmp_path / "bad.jsonl", relabeled)
    out = tmp_path / "artifact"
    proc = run_optimize(*text_overrides(model, data, out, f"evaluate.data.path={bad}", f"calibration.path={bad}"))
    one_error_line(proc, fragment)
    assert not out.exists()


@pytest.mark.parametrize("task", ["text_classification", "token_classification"])
def test_a_classifier_distills_into_a_smaller_student_on_its_logits(task, text_setup, ner_setup, tmp_path):
    """Logit KD: a one-layer student of the two-layer classifier, trained on the teacher's class
    distribution (per token for NER), judged on labeled accuracy like any candidate."""
    model, data = text_setup if task == "text_classification" else ner_setup
    out = tmp_path / "artifact"
    overrides = text_overrides(model, data, out, "distill=logit_hidden_kd", "distill.params.student_layers=1")
    overrides += ["distill.params.max_steps=40", "distill.params.seq_len=32", "distill.params.batch_size=8"]
    overrides += ["gate.max_accuracy_drop=100", "gate.max_f1_drop=100", "gate.min_prediction_agreement=0"]
    if task == "token_classification":  # word lists with a tag per word; plain text trains the student
        overrides = [o.replace("text_classification", task) for o in overrides if not o.startswith("calibration.")]
        overrides += ["evaluate.data.field=tokens", "evaluate.data.label_field=tags", "evaluate.data.count=30"]
        overrides += ["calibration.source=cpython_docs", "calibration.count=16"]
    proc = run_optimize(*overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["stages"]["distill"]
    assert record["layer_map"] == [1] and record["loss_curve_summary"]["steps"] == 40
    assert record["loss_curve_summary"]["last5_mean"] < record["loss_curve_summary"]["first5_mean"]  # it learned
    assert (out / "distill" / "loss_curve.png").is_file() and (out / "labels.json").is_file()
    figure = "accuracy" if task == "text_classification" else "entity_f1"
    assert figure in manifest["metrics"]["candidate"] and manifest["verdict"] == "passed"


def test_a_classifier_prunes_by_importance_then_distills(text_setup, tmp_path):
    """Structured pruning ranks the classifier's layers and heads on calibration text (the task head
    stays), and the pruned model is the distillation's student."""
    model, data = text_setup
    out = tmp_path / "artifact"
    overrides = text_overrides(model, data, out, "prune=structured", "prune.params.layers=1", "prune.params.heads=1")
    overrides += ["prune.params.calibration_samples=8", "distill=logit_hidden_kd", "distill.params.max_steps=30"]
    overrides += ["distill.params.seq_len=32", "distill.params.batch_size=8"]
    overrides += ["gate.max_accuracy_drop=100", "gate.max_f1_drop=100", "gate.min_prediction_agreement=0"]
    proc = run_optimize(*overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    pruned, distilled = manifest["stages"]["prune"], manifest["stages"]["distill"]
    assert len(pruned["kept_layers"]) == 1 and distilled["layer_map"] == [1]
    assert pruned["parameters"]["after"] < pruned["parameters"]["before"]
    assert "accuracy" in manifest["metrics"]["candidate"] and manifest["verdict"] == "passed"
