"""The digits CNN end to end: training script, image_classification task, static INT8 recipe gated on
held-out accuracy, and the calibration errors a user can hit from the command line (exit 2, one line)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.cli import one_error_line, run_optimize

pytest.importorskip("sklearn")
FAST = [
    "evaluate.latency=false",
    "calibration.count=64",
    "quantize.params.calibration_count=64",
    "evaluate.data.count=200",
]


def test_training_script_writes_a_loadable_safetensors_checkpoint(tmp_path):
    from optimize.tasks.image_classification import encode_images, load_cnn
    from optimize.train.digits import train

    trained = train(tmp_path / "cnn", epochs=1, seed=1)
    assert (tmp_path / "cnn" / "model.safetensors").is_file() and trained["items"] > 1000
    assert trained["heldout_top1_accuracy"] > 0.5  # one epoch already learns digits
    module, config = load_cnn(tmp_path / "cnn")
    import torch

    logits = module(torch.from_numpy(encode_images([np.zeros((8, 8), np.float32)])["pixel_values"]))
    assert tuple(logits.shape) == (1, config["num_classes"])


def test_checked_in_checkpoint_is_accurate():
    import torch

    from calibration.images import digits
    from optimize.sources.models import resolve_package_path
    from optimize.tasks.image_classification import encode_images, load_cnn, top1_accuracy

    module, config = load_cnn(resolve_package_path("pkg://optimize/assets/digits_cnn"))
    held_out = digits("evaluation")
    with torch.inference_mode():
        logits = module(torch.from_numpy(encode_images(held_out.items)["pixel_values"])).numpy()
    assert top1_accuracy(logits, np.asarray(held_out.labels)) > 0.95


def test_digits_static_int8_recipe_passes_on_accuracy(tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        "recipe=digits_cnn_int8_static", *FAST, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    base, cand = manifest["metrics"]["baseline"], manifest["metrics"]["candidate"]
    assert base["top1_accuracy"] > 0.95 and cand["top1_accuracy"] > 0.95
    assert cand["accuracy_drop_points"] == pytest.approx(100 * (base["top1_accuracy"] - cand["top1_accuracy"]))
    assert {c["name"] for c in manifest["gate"]["checks"]} == {"max_accuracy_drop", "min_accuracy"}
    assert manifest["calibration"]["source"] == "digits" and manifest["calibration"]["count"] == 64
    assert len(manifest["calibration"]["sha256"]) == 64 and manifest["evaluation"]["dropped_overlap"] == 0
    assert manifest["stages"]["quantize"]["method"] == "ort_int8_static_qdq"
    assert "top-1 accuracy drop" in proc.stdout


def test_the_race_judges_an_image_classifier_on_the_gates_labeled_accuracy(tmp_path):
    """engine=auto takes any task: each candidate is scored on top-1 accuracy (what this gate reads),
    and the final evaluation of the winner's shipped files gives the same figure."""
    out = tmp_path / "artifact"
    proc = run_optimize(
        "recipe=digits_cnn_int8_static",
        "quantize=none",
        "engine=auto",
        "engine.params.candidates=[ort_fp32,openvino_int8]",
        "engine.params.timing_repeats=2",
        "evaluate.latency=false",
        "evaluate.data.count=200",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    race = {c["name"]: c for c in manifest["stages"]["engine"]["candidates"]}
    assert set(race) == {"ort_fp32", "openvino_int8"}
    assert all({"top1_accuracy", "accuracy_drop_points"} <= set(c["scores"]) for c in race.values())
    winner = race[manifest["stages"]["engine"]["winner"]]
    assert winner["outcome"].startswith("won")
    assert manifest["metrics"]["candidate"]["top1_accuracy"] == pytest.approx(winner["scores"]["top1_accuracy"])


@pytest.mark.parametrize(
    "override,expected",
    [
        ("calibration.count=0", "count=0"),
        ("calibration.source=none", "no data source"),
        ("calibration.source=text_file", "needs a path"),
    ],
)
def test_missing_calibration_data_exits_2(tmp_path, override, expected):
    proc = run_optimize(
        "recipe=digits_cnn_int8_static", override, f"output_dir={tmp_path / 'a'}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert expected in one_error_line(proc, log_lines=True)
    assert not (tmp_path / "a").exists()


def test_empty_calibration_file_exits_2(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = run_optimize(
        "recipe=digits_cnn_int8_static",
        "calibration.source=text_file",
        f"calibration.path={empty}",
        f"output_dir={tmp_path / 'a'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert "is empty" in one_error_line(proc, log_lines=True)


def test_overlapping_evaluation_data_is_refused(tmp_path):
    proc = run_optimize(
        "recipe=digits_cnn_int8_static",
        "evaluate.data.split=calibration",
        "evaluate.data.count=300",
        "calibration.count=300",
        f"output_dir={tmp_path / 'a'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert "also appear in the calibration data" in one_error_line(proc, log_lines=True)


@pytest.mark.slow
def test_overlap_drop_is_recorded(tmp_path):
    out = tmp_path / "a"
    proc = run_optimize(
        "recipe=digits_cnn_int8_static",
        *FAST,
        "evaluate.data.split=calibration",
        "evaluate.data.count=300",
        "calibration.count=300",
        "evaluate.overlap=drop",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    evaluation = json.loads((out / "manifest.json").read_text())["evaluation"]
    assert evaluation["dropped_overlap"] > 0 and evaluation["count"] == 300 - evaluation["dropped_overlap"]


def test_gpu_recipe_without_gpu_exits_2_naming_what_is_missing(tmp_path):
    from engines.onnxruntime.providers import missing_for

    if not missing_for("TensorrtExecutionProvider"):
        pytest.skip("this machine has a GPU with TensorRT")
    proc = run_optimize("recipe=minilm_fp16_trt", f"output_dir={tmp_path / 'a'}", f"hydra.run.dir={tmp_path / 'run'}")
    line = one_error_line(proc, log_lines=True)
    assert "TensorrtExecutionProvider" in line and "lacks" in line


def test_text_data_for_an_image_model_is_refused(tmp_path):
    proc = run_optimize(
        "recipe=digits_cnn_int8_static",
        "evaluate.data.source=cpython_docs",
        "evaluate.data.count=16",
        "evaluate.latency=false",
        f"output_dir={tmp_path / 'a'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert "has no labels" in one_error_line(proc, log_lines=True)
