"""Calibration data: every source, seeded and hashed; bad sources are one clear DataError; overlap check."""

from __future__ import annotations

import json

import numpy as np
import pytest

import calibration
from calibration import DataError


def test_digits_has_real_labels_and_disjoint_splits():
    cal = calibration.load("digits", "calibration", 64, seed=0)
    ev = calibration.load("digits", "evaluation", 64, seed=0)
    assert len(cal.labels) == 64 and set(cal.labels) <= set(range(10)) and cal.items[0].shape == (8, 8)
    assert not set(cal.item_hashes) & set(calibration.load("digits", "evaluation", ev.available, 0).item_hashes)
    assert cal.available + ev.available == 1797


def test_sampling_is_seeded_and_hashed():
    a, b = (calibration.load("digits", "calibration", 16, seed=3) for _ in range(2))
    c = calibration.load("digits", "calibration", 16, seed=4)
    assert a.sha256 == b.sha256 != c.sha256 and a.labels == b.labels
    described = a.describe()
    assert described["count"] == 16 and described["seed"] == 3 and described["source"] == "digits"
    assert described["sha256"] == a.sha256 and "random" not in described


def test_cpython_docs_text():
    data = calibration.load("cpython_docs", "calibration", 4, seed=0)
    assert all(isinstance(t, str) and len(t) >= 200 for t in data.items)


@pytest.mark.slow
def test_python_docstrings_are_real_prose_split_by_module():
    cal = calibration.load("python_docstrings", "calibration", 8, seed=0)
    assert all(isinstance(t, str) and len(t) >= 200 for t in cal.items)
    calibration_all = set(calibration.python_docstrings("calibration"))
    evaluation_all = set(calibration.python_docstrings("evaluation"))
    assert len(calibration_all) > 1000 and len(evaluation_all) > 200 and not calibration_all & evaluation_all


def test_python_prose_joins_both_sources_and_stays_disjoint_from_evaluation():
    prose = set(calibration.python_prose("calibration"))
    assert set(calibration.cpython_docs("calibration")) <= prose
    assert not prose & set(calibration.cpython_docs("evaluation"))


def test_parquet_source(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"body": [f"sentence number {i}" for i in range(80)]}), path)
    data = calibration.load("parquet", "calibration", 10, 0, path=str(path), field="body")
    assert len(data.items) == 10 and data.describe()["path"] == str(path)
    with pytest.raises(DataError, match="no column 'text'"):
        calibration.load("parquet", "calibration", 10, 0, path=str(path), field="text")


def test_hf_dataset_local_file(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} of the local data set"}) + "\n" for i in range(40)))
    whole = calibration.load("hf_dataset", "evaluation", 40, 0, path=str(path), dataset_split="train")
    assert whole.available == 40 and whole.describe()["dataset_split"] == "train"
    hashed = calibration.load("hf_dataset", "calibration", 5, 0, path=str(path))
    assert 5 <= hashed.available < 40  # without dataset_split the train split is divided by hash


def test_hf_dataset_offline_hub_name_is_a_data_error(monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="cannot load dataset"):
        calibration.load("hf_dataset", "calibration", 4, 0, path="no-such-owner/no-such-dataset")


def test_random_only_by_name_and_recorded():
    data = calibration.load("random", "calibration", 4, 0, shape=[8, 8])
    assert data.items[0].shape == (8, 8) and data.describe()["random"] is True
    texts = calibration.load("random", "evaluation", 4, 0)
    assert isinstance(texts.items[0], str) and "random" in texts.describe()["note"]
    assert (
        calibration.load("random", "calibration", 4, 0, shape=[2]).sha256
        != calibration.load("random", "evaluation", 4, 0, shape=[2]).sha256
    )


@pytest.mark.parametrize("name", [None, "none", ""])
def test_no_source_is_an_error_not_random(name):
    with pytest.raises(DataError, match="no data source"):
        calibration.load(name, "calibration", 4, 0)


def test_zero_count_is_an_error():
    with pytest.raises(DataError, match="count=0"):
        calibration.load("digits", "calibration", 0, 0)


def test_unknown_source_and_too_few_items():
    with pytest.raises(DataError, match="unknown data source"):
        calibration.load("imagenet", "calibration", 4, 0)
    with pytest.raises(DataError, match="asks for 100000"):
        calibration.load("digits", "calibration", 100000, 0)


@pytest.mark.parametrize(
    "source,content",
    [
        ("text_file", b""),
        ("jsonl", b"\n\n"),
        ("parquet", b"not parquet"),
        ("text_file", b"\xff\xfe bad utf-8 " * 40),
        ("jsonl", b"{broken\n"),
    ],
)
def test_empty_or_unreadable_files(tmp_path, source, content):
    path = tmp_path / "data.bin"
    path.write_bytes(content)
    with pytest.raises(DataError):
        calibration.load(source, "calibration", 1, 0, path=str(path), min_chars=1)


@pytest.mark.parametrize("source", ["text_file", "jsonl", "parquet", "hf_dataset"])
def test_missing_file(tmp_path, source):
    with pytest.raises(DataError):
        calibration.load(source, "calibration", 1, 0, path=str(tmp_path / "absent.txt"))


def test_overlap_by_content_hash_refuses_or_drops_with_labels():
    cal = calibration.load("digits", "calibration", 300, seed=0)
    ev = calibration.load("digits", "calibration", 300, seed=1)  # same split: some items overlap
    shared = set(cal.item_hashes) & set(ev.item_hashes)
    assert shared
    with pytest.raises(DataError, match=f"{len(shared)} evaluation items"):
        calibration.remove_overlap(cal, ev, "error")
    kept = calibration.remove_overlap(cal, ev, "drop")
    assert kept.dropped_overlap == len(shared) and len(kept.items) == len(kept.labels) == 300 - len(shared)
    assert not set(kept.item_hashes) & set(cal.item_hashes)
    assert kept.describe()["dropped_overlap"] == len(shared)


def test_array_hash_depends_on_content_not_identity():
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    assert calibration.item_hash(a) == calibration.item_hash(a.copy())
    assert calibration.item_hash(a) != calibration.item_hash(a.astype(np.float64))
    assert calibration.item_hash(a) != calibration.item_hash(a.reshape(4, 16))
