"""Tabular and Hugging Face `datasets` sources: parquet files, and any dataset `datasets` can load
(local parquet/json/jsonl/csv/text files here; hub names on a networked machine)."""

from __future__ import annotations

import os
from pathlib import Path

from calibration import DataError, _split_items, check_data_file, source

# File suffix -> the `datasets` builder that reads it.
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


def _texts(rows: list, field: str, where: str, min_chars: int) -> list[str]:
    if rows and not isinstance(rows[0], str):
        raise DataError(f"{where}: column {field!r} holds {type(rows[0]).__name__}, not text")
    return [r for r in rows if r is not None and len(r) >= min_chars]


@source("parquet")
def parquet(split: str, path: str | None = None, field: str = "text", min_chars: int = 1, **_) -> list[str]:
    """A parquet file; column `field` holds the text. Items are split by content hash."""
    import pyarrow.parquet as pq

    if not path:
        raise DataError("the parquet source needs a path")
    table = pq.read_table(str(check_data_file(path)))
    if field not in table.column_names:
        raise DataError(f"{path} has no column {field!r} (columns: {', '.join(table.column_names)})")
    return _split_items(_texts(table.column(field).to_pylist(), field, path, min_chars), split)


@source("hf_dataset")
def hf_dataset(
    split: str, path: str | None = None, field: str = "text", min_chars: int = 1, dataset_split: str | None = None, **_
) -> list[str]:
    """A Hugging Face dataset: `path` is a local file or folder, or a hub name. With `dataset_split`
    (e.g. test) every item of that split is used; without it the train split is divided by content hash."""
    if not path:
        raise DataError("the hf_dataset source needs a path (a local file or folder, or a hub dataset name)")
    rows = _load_dataset(path, dataset_split or "train")
    if field not in rows.column_names:
        raise DataError(f"dataset {path} has no column {field!r} (columns: {', '.join(rows.column_names)})")
    texts = _texts(rows[field], field, path, min_chars)
    return texts if dataset_split else _split_items(texts, split)


def _load_dataset(path: str, dataset_split: str):
    import datasets

    local = Path(path).expanduser()
    try:
        if os.path.lexists(local) and not local.is_dir():
            check_data_file(path)  # a FIFO, device, link or oversized file is refused before any reader opens it
            builder = _BUILDERS.get(local.suffix)
            if builder is None:
                raise DataError(
                    f"{path}: cannot tell the format of {local.suffix or 'a file without suffix'} "
                    f"(known: {', '.join(_BUILDERS)})"
                )
            return datasets.load_dataset(builder, data_files={dataset_split: str(local)}, split=dataset_split)
        return datasets.load_dataset(str(local) if local.exists() else path, split=dataset_split)
    except DataError:
        raise
    except Exception as exc:  # hub unreachable, unknown split, malformed file: one line for the user
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot load dataset {path} (split {dataset_split}): {text}") from None
