"""Labeled text for classifiers: a user's file or saved dataset (`labeled`), and a real labeled set
built from text that ships with the pipeline's own dependencies (`package_docstrings`).

    evaluate:
      data: {source: labeled, path: eval.jsonl, field: text, label_field: label}      # sequence classes
      data: {source: labeled, path: ner_ds/, field: tokens, label_field: ner_tags}    # NER (words, tags)

`labeled` reads jsonl, json, csv and parquet files and folders written by `datasets`'
`save_to_disk`. A text column gives items that are strings; a column of word lists (NER) gives
items that are lists of words, with one tag per word in the label column. Labels may be names or
integer ids; a `datasets` ClassLabel column is turned back into its names, so the check against
the model's id2label compares names. Without `dataset_split` the rows are divided into
calibration and evaluation by a hash of their text; with it (any name for a file, a split's name for
a saved DatasetDict) every row is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from calibration import DataError, Labeled, _in_split, check_data_file, source

# Python packages the pipeline installs whose docstrings are distinct enough to tell apart, and
# plentiful (thousands of paragraphs each): the classes of the shipped classifier.
DOCSTRING_PACKAGES = ("matplotlib", "networkx", "pandas", "sklearn", "sympy", "torch")
_SKIPPED_PARTS = {"tests", "test", "testing", "_vendor", "vendored", "externals", "__pycache__"}


@source("labeled")
def labeled(
    split: str,
    path: str | None = None,
    field: str = "text",
    label_field: str | None = "label",
    dataset_split: str | None = None,
    min_chars: int = 1,
    **_,
) -> Labeled:
    """Rows of a local file or saved dataset with a text (or word-list) column and a label column."""
    if not path:
        raise DataError("the labeled source needs a path (a jsonl, csv or parquet file, or a save_to_disk folder)")
    label_field = label_field or "label"
    columns, names = _read_table(path, dataset_split)
    for column in (field, label_field):
        if column not in columns:
            raise DataError(f"{path} has no column {column!r} (columns: {', '.join(sorted(columns))})")
    items, labels = columns[field], columns[label_field]
    if label_field in names:  # a ClassLabel column: ids back to the names the model's id2label holds
        labels = [_names_of(value, names[label_field], path, label_field) for value in labels]
    rows = [(_item(x, path, field), _label(y, x, path, label_field)) for x, y in zip(items, labels)]
    rows = [(x, y) for x, y in rows if not isinstance(x, str) or len(x) >= min_chars]
    if dataset_split is None:
        rows = [(x, y) for x, y in rows if _in_split(_key(x), split)]
    return Labeled([x for x, _ in rows], [y for _, y in rows], {"label_field": label_field})


def _read_table(path: str, dataset_split: str | None) -> tuple[dict[str, list], dict[str, list[str]]]:
    """(columns by name, ClassLabel names by column) of a file or a save_to_disk folder."""
    local = Path(path).expanduser()
    if local.is_dir():
        return _read_saved_dataset(local, dataset_split)
    check_data_file(path)
    suffix = local.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(local), {}
    if suffix == ".csv":
        import pandas as pd

        frame = pd.read_csv(local, keep_default_na=False)
        return {c: frame[c].tolist() for c in frame.columns}, {}
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(str(local))
        return {c: table.column(c).to_pylist() for c in table.column_names}, {}
    raise DataError(f"{path}: the labeled source reads .jsonl, .json, .csv, .parquet or a save_to_disk folder")


def _read_jsonl(local: Path) -> dict[str, list]:
    from calibration import _read

    rows = []
    for number, line in enumerate(_read(str(local)).decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{local}:{number} is not JSON: {exc.msg}") from None
    if not rows:
        raise DataError(f"{local} holds no rows")
    keys = set().union(*(r.keys() for r in rows))
    return {k: [r.get(k) for r in rows] for k in keys}


def _read_saved_dataset(local: Path, dataset_split: str | None) -> tuple[dict[str, list], dict[str, list[str]]]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(local))
    except FileNotFoundError:
        raise DataError(f"{local} is not a folder written by datasets' save_to_disk") from None
    if isinstance(saved, datasets.DatasetDict):
        chosen = dataset_split or ("test" if "test" in saved else next(iter(saved)))
        if chosen not in saved:
            raise DataError(f"{local} has no split {chosen!r} (splits: {', '.join(saved)})")
        saved = saved[chosen]
    names = {}
    for column, feature in saved.features.items():
        inner = getattr(feature, "feature", feature)  # Sequence(ClassLabel) for NER tags
        if isinstance(inner, datasets.ClassLabel):
            names[column] = list(inner.names)
    return {c: saved[c] for c in saved.column_names}, names


def _names_of(value, names: list[str], path: str, label_field: str):
    """A ClassLabel id (or a row's list of them) as its name. -1 is `datasets`' "no label" (a GLUE
    test split holds only that): refused, never read as names[-1], the last class."""
    if isinstance(value, list):
        return [_names_of(v, names, path, label_field) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(names):
        return names[value]
    if value == -1:
        raise DataError(
            f"{path}: column {label_field!r} holds -1, datasets' 'no label' (a test split without labels?): "
            "choose a labeled split with dataset_split=NAME, or drop the unlabeled rows"
        )
    raise DataError(f"{path}: column {label_field!r} holds {value!r}, not one of its {len(names)} ClassLabel ids")


def _item(value, path: str, field: str):
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(w, str) for w in value):
        return [str(w) for w in value]
    raise DataError(f"{path}: column {field!r} holds {type(value).__name__}, not text or a list of words")


def _label(value, item, path: str, label_field: str):
    """A class (name or id) for a text; a list of them, one per word, for a word list."""
    if isinstance(item, list):
        if not isinstance(value, list) or len(value) != len(item):
            raise DataError(f"{path}: column {label_field!r} must hold one tag per word (a row has {len(item)} words)")
        return [_scalar(v, path, label_field) for v in value]
    return _scalar(value, path, label_field)


def _scalar(value, path: str, label_field: str):
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        raise DataError(f"{path}: column {label_field!r} holds {value!r}, not a label name or id")
    if isinstance(value, float):
        if not value.is_integer():
            raise DataError(f"{path}: column {label_field!r} holds {value!r}, not a label name or id")
        return int(value)
    return value


def _key(item) -> str:
    return item if isinstance(item, str) else "\x1f".join(item)


# ------------------------------------------------------------------ package docstrings


@source("package_docstrings")
def package_docstrings(
    split: str, min_chars: int = 120, packages: tuple[str, ...] = DOCSTRING_PACKAGES, **_
) -> Labeled:
    """Docstring paragraphs of installed packages (`packages`), labeled with the package they come from
    (read with `ast`, nothing imported). Split by module file: a module's paragraphs are all in one
    split, so the evaluation split is text from modules the classifier never saw. Balanced: every
    package gives as many paragraphs as the smallest one has in the split."""
    per_package = {name: _package_paragraphs(name, split, min_chars) for name in packages}
    if split == "evaluation":  # docstrings are copied between modules: keep only text training never saw
        seen = {p for name in packages for p in _package_paragraphs(name, "calibration", min_chars)}
        per_package = {name: tuple(p for p in found if p not in seen) for name, found in per_package.items()}
    missing = [name for name, paragraphs in per_package.items() if not paragraphs]
    if missing:
        raise DataError(f"package_docstrings: no docstrings found for {', '.join(missing)} (not installed?)")
    share = min(len(p) for p in per_package.values())
    items, labels = [], []
    for name, paragraphs in per_package.items():
        # The same paragraphs whatever the others have: ordered by their hash, then cut.
        chosen = sorted(paragraphs, key=lambda p: hashlib.sha256(p.encode()).digest())[:share]
        items += chosen
        labels += [name] * len(chosen)
    return Labeled(items, labels, {"packages": list(packages), "per_package": share})


@functools.lru_cache(maxsize=32)
def _package_paragraphs(package: str, split: str, min_chars: int) -> tuple[str, ...]:
    import ast
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return ()
    root = Path(list(spec.submodule_search_locations)[0])
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED_PARTS & set(relative.parts) or not _in_split(f"{package}/{relative}", split):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                found += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.strip()) >= min_chars]
    return tuple(dict.fromkeys(found))
