"""The labeled data source: jsonl, csv, parquet and datasets' save_to_disk folders, text or word
lists, label names or ids (a ClassLabel column read back as names), and its one-line refusals."""

from __future__ import annotations

import importlib.util
import json

import pytest

import calibration
from calibration.labeled import labeled

ROWS = [
    {"text": f"paragraph number {i} about {'cats' if i % 2 else 'dogs'}", "label": ["dog", "cat"][i % 2]}
    for i in range(40)
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def both_splits(**kw):
    return [labeled(split, **kw) for split in calibration.SPLITS]


def test_jsonl_splits_by_text_hash_and_keeps_labels_with_their_items(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    calib, evaluation = both_splits(path=str(path))
    assert len(calib.items) + len(evaluation.items) == len(ROWS)
    assert not set(calib.items) & set(evaluation.items)
    truth = {r["text"]: r["label"] for r in ROWS}
    assert all(truth[x] == y for x, y in zip(evaluation.items, evaluation.labels))
    whole = labeled("evaluation", path=str(path), dataset_split="all")
    assert len(whole.items) == len(ROWS)


def test_csv_and_parquet_read_the_named_columns(tmp_path):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"body": [r["text"] for r in ROWS], "y": [i % 3 for i in range(len(ROWS))]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        got = labeled("evaluation", path=str(tmp_path / name), field="body", label_field="y", dataset_split="all")
        assert got.items == frame["body"].tolist() and got.labels == frame["y"].tolist()


def test_saved_dataset_with_classlabel_tags_reads_names(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "tokens": datasets.Sequence(datasets.Value("string")),
            "ner_tags": datasets.Sequence(datasets.ClassLabel(names=["O", "B-PER", "I-PER"])),
        }
    )
    rows = {"tokens": [["Ada", "Lovelace", "wrote"], ["it", "ran"]], "ner_tags": [[1, 2, 0], [0, 0]]}
    split = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict({"test": split}).save_to_disk(str(tmp_path / "ner"))
    got = labeled(
        "evaluation", path=str(tmp_path / "ner"), field="tokens", label_field="ner_tags", dataset_split="test"
    )
    assert got.items == rows["tokens"]
    assert got.labels == [["B-PER", "I-PER", "O"], ["O", "O"]]


@pytest.mark.parametrize(
    "rows, kw, fragment",
    [
        (ROWS, {"label_field": "category"}, "has no column 'category'"),
        ([{"text": "a", "label": None}], {}, "not a label name or id"),
        ([{"text": ["a", "b"], "label": ["O"]}], {}, "one tag per word"),
        ([{"text": 3, "label": "x"}], {}, "not text or a list of words"),
    ],
)
def test_bad_columns_are_one_data_error(tmp_path, rows, kw, fragment):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(calibration.DataError, match=fragment):
        labeled("evaluation", path=str(path), dataset_split="all", **kw)


@pytest.mark.slow
def test_package_docstrings_is_balanced_and_held_out_by_module():
    # On three of the packages the source reads by default (parsing torch's and sympy's sources is most
    # of its time: 14 of 19 s); every one of them is installed.
    packages = ("matplotlib", "networkx", "sklearn")
    assert all(importlib.util.find_spec(name) for name in calibration.labeled.DOCSTRING_PACKAGES)
    calib = calibration.load("package_docstrings", "calibration", 60, 0, packages=packages)
    evaluation = calibration.labeled.package_docstrings("evaluation", packages=packages)
    assert set(calib.labels) <= set(packages) and calib.extra["packages"] == list(packages)
    counts = {name: evaluation.labels.count(name) for name in set(evaluation.labels)}
    assert len(set(counts.values())) == 1 and set(counts) == set(packages)
    assert not set(evaluation.items) & set(
        calibration.labeled.package_docstrings("calibration", packages=packages).items
    )


def test_a_classlabel_without_a_label_is_refused_not_read_as_the_last_class(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    rows = {"text": ["a fine film", "an unlabeled test row"], "label": [0, -1]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "glue"))
    with pytest.raises(calibration.DataError, match="'no label'"):
        labeled("evaluation", path=str(tmp_path / "glue"), dataset_split="all")
