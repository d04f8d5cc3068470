"""`python -m optimize.train.classifier`: bad arguments are one line, exit 2, before any training or
writing (training itself is exercised by the recipe it feeds, on an idle machine it takes minutes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from optimize.train import classifier as train_classifier
from tests.support.cli import ROOT, one_error_line


def run_tool(*args, cwd=ROOT, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "optimize.train.classifier", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--steps", "-1"], "--steps -1: give at least 1"),
        (["--budget-s", "-5"], "--budget-s -5.0: give a positive number of seconds"),
        (["--budget-s", "nan"], "--budget-s nan"),
        (["--threads", "-2"], "--threads -2"),
        (["--trained-layers", "0"], "--trained-layers 0: give at least 1"),
        (["--budget-s", "x"], "invalid float value"),
        (["--budget-s", "inf"], "--budget-s inf: give a finite number"),
        (["--seed", "-1"], "--seed -1: give a whole number"),
        (["--seed", "1" * 22], "--seed 1111"),
    ],
)
def test_bad_arguments_are_one_line(args, fragment, tmp_path):
    out = tmp_path / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train.classifier", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    one_error_line(proc, fragment)
    assert not out.exists()


def test_a_file_where_the_folder_goes_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train.classifier", str(target)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    one_error_line(proc, "exists and is not a folder")
    assert target.read_text() == "keep me"


def test_a_folder_the_tool_did_not_write_is_refused_and_kept(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    one_error_line(run_tool(str(folder)), "did not write")
    # "." is the folder it runs in, which holds the user's files too
    one_error_line(run_tool(".", cwd=folder), "did not write")
    assert (folder / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left


@pytest.mark.parametrize("where", ["/proc/optimize-classifier", "FILE/model"])
def test_an_unusable_output_folder_is_refused_before_training(where, tmp_path):
    (tmp_path / "FILE").write_text("a file")
    where = where.replace("FILE", str(tmp_path / "FILE"))
    one_error_line(run_tool(where), where.split("/model")[0] if "FILE" not in where else "is not a folder")


def test_a_previous_output_is_swapped_whole_for_the_new_one(tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification

    from tests.support.tiny_classifiers import _config, minilm_dir

    out = tmp_path / "classifier"
    out.mkdir()
    (out / train_classifier.MARKER).write_text("")
    (out / "stale.bin").write_text("from the last run")
    target, stage = train_classifier.prepare_output(out)
    model = BertForSequenceClassification(_config(("a", "b")))
    train_classifier.save(model, AutoTokenizer.from_pretrained(str(minilm_dir())), stage, target, {"steps": 1})
    assert not (out / "stale.bin").exists() and (out / "model.safetensors").is_file()
    assert (out / train_classifier.MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["classifier"]  # staging and the old copy are gone
    # the new folder is a previous output for the next run, a foreign one is not
    assert train_classifier.is_previous_output(out)
    assert not train_classifier.is_previous_output(tmp_path)


@pytest.mark.slow
def test_a_budget_spent_before_any_step_is_refused_and_keeps_the_previous_classifier(tmp_path, monkeypatch, capsys):
    """The tool's own main() in this process, on a few labeled paragraphs: reading every docstring of
    six installed packages (a minute of parsing, what the tool trains on) is not what is tested."""
    import calibration.labeled
    from calibration import Labeled

    packages = calibration.labeled.DOCSTRING_PACKAGES
    few = Labeled([f"paragraph {i} about {name}" for i, name in enumerate(packages)], list(packages))
    monkeypatch.setattr(calibration.labeled, "package_docstrings", lambda split: few)
    out = tmp_path / "classifier"
    out.mkdir()
    (out / train_classifier.MARKER).write_text("")
    (out / "model.safetensors").write_text("the classifier a recipe uses")
    monkeypatch.setattr(sys, "argv", ["classifier", str(out), "--steps", "1", "--budget-s", "1e-9"])
    with pytest.raises(SystemExit) as ended:
        train_classifier.main()
    err = capsys.readouterr().err
    one_error_line(
        subprocess.CompletedProcess(sys.argv, ended.value.code, "", err),
        "before the first training step",
        log_lines=True,
    )
    assert (out / "model.safetensors").read_text() == "the classifier a recipe uses"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["classifier"]
