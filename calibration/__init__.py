"""Calibration and evaluation data: seeded, hashed, and disjoint.

Every source yields the items of a split (texts or arrays, optionally with labels); `load` draws a
fixed count with a seed and records exactly what was drawn (count, seed and a sha256 over the items
in order), so a manifest can say what calibrated or evaluated a model, and a rerun draws the same
items. Sources: cpython_docs, text_file, jsonl (here); parquet, hf_dataset (files.py); digits
(images.py); image_folder, npy, audio_folder (media.py: ready tensors for models that take them);
random (synthetic.py, only when a recipe names it, and the manifest says so).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

SPLITS = ("calibration", "evaluation")


class DataError(Exception):
    """A data source is missing, empty or unreadable."""


def item_hash(item: Any) -> str:
    """sha256 of an item's content: text as UTF-8; an array as its dtype, shape and bytes (so the
    same pixels hash alike whatever list or file they came from)."""
    if isinstance(item, str):
        return hashlib.sha256(item.encode("utf-8")).hexdigest()
    array = np.ascontiguousarray(item)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).hexdigest()


@dataclass
class Labeled:
    """What a source returns when its items carry labels (for accuracy: items[i] has labels[i]) or
    when it says how it made them (`extra`: preprocessing, recorded in the manifest)."""

    items: list
    labels: list | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class TextSet:
    """A drawn data set: texts or arrays (the name stays for the text sources that came first)."""

    source: str
    split: str
    seed: int
    items: list
    available: int  # items in the split before sampling
    dropped_overlap: int = 0
    extra: dict = field(default_factory=dict)
    labels: list | None = None

    @property
    def item_hashes(self) -> list[str]:
        return [item_hash(t) for t in self.items]

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for h in self.item_hashes:
            digest.update(h.encode())
        return digest.hexdigest()

    def describe(self) -> dict:
        return {
            "source": self.source,
            "split": self.split,
            "count": len(self.items),
            "seed": self.seed,
            "available": self.available,
            "sha256": self.sha256,
            "dropped_overlap": self.dropped_overlap,
            **self.extra,
        }


_SOURCES: dict[str, Callable[..., list[str]]] = {}


def source(name: str):
    def decorate(fn):
        _SOURCES[name] = fn
        return fn

    return decorate


DataSet = TextSet


def _in_split(key: Any, split: str) -> bool:
    """Assign items (or whole documents) to a split by a hash of their content: one in four is held out."""
    held_out = bytes.fromhex(item_hash(key))[0] % 4 == 0
    return held_out == (split == "evaluation")


def _paragraphs(text: str, min_chars: int) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) >= min_chars]


@source("cpython_docs")
def cpython_docs(split: str, min_chars: int = 200, **_) -> list[str]:
    """English prose that ships with CPython (pydoc topics), split by document."""
    from pydoc_data.topics import topics

    def paragraphs_of(part: str) -> list[str]:
        return [p for key in sorted(topics) if _in_split(key, part) for p in _paragraphs(topics[key], min_chars)]

    if split == "calibration":
        return list(dict.fromkeys(paragraphs_of("calibration")))
    # Some paragraphs recur across documents: evaluation keeps only those calibration never sees.
    seen = set(paragraphs_of("calibration"))
    return [p for p in dict.fromkeys(paragraphs_of("evaluation")) if p not in seen]


@source("python_docstrings")
def python_docstrings(split: str, min_chars: int = 200, **_) -> list[str]:
    """English prose from the docstrings of the Python standard library (modules, classes and
    functions: ~1,660 calibration paragraphs of 200+ characters, three times the pydoc topics'),
    read with `ast` so nothing is imported or run, split by module. Test suites are left out."""
    if split == "calibration":
        return list(_stdlib_docstrings("calibration", min_chars))
    seen = set(_stdlib_docstrings("calibration", min_chars))  # docstrings recur across modules
    return [p for p in _stdlib_docstrings("evaluation", min_chars) if p not in seen]


@functools.lru_cache(maxsize=8)
def _stdlib_docstrings(split: str, min_chars: int) -> tuple[str, ...]:
    """Parsing the standard library takes seconds: done once per process and split."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    items = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if skipped & set(relative.parts) or not _in_split(str(relative), split):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):  # a few stdlib files are templates
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                items += _paragraphs(ast.get_docstring(node) or "", min_chars)
    return tuple(dict.fromkeys(items))


@source("python_prose")
def python_prose(split: str, min_chars: int = 200, **_) -> list[str]:
    """cpython_docs and python_docstrings together (each split its own way, duplicates removed)."""
    return list(dict.fromkeys(cpython_docs(split, min_chars) + python_docstrings(split, min_chars)))


def _split_items(items: list, split: str) -> list:
    return [t for t in items if _in_split(t, split)]


@source("text_file")
def text_file(split: str, path: str | None = None, min_chars: int = 200, **_) -> list[str]:
    """A UTF-8 text file; paragraphs (blank-line separated) are the items, split by their hash."""
    text = _read(path).decode("utf-8", errors="strict")
    return _split_items(_paragraphs(text, min_chars), split)


@source("jsonl")
def jsonl(split: str, path: str | None = None, field: str = "text", min_chars: int = 1, **_) -> list[str]:
    """One JSON object per line; `field` holds the text."""
    items = []
    for number, line in enumerate(_read(path).decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number} is not JSON: {exc.msg}") from None
        if field not in record:
            raise DataError(f"{path}:{number} has no field {field!r}")
        if len(str(record[field])) >= min_chars:
            items.append(str(record[field]))
    return _split_items(items, split)


# Data files are read whole: past this size a file is refused instead of filling memory (calibration
# and evaluation draw at most a few thousand items). OPTIMIZE_MAX_DATA_BYTES raises it.
MAX_DATA_BYTES = 64 << 20
MAX_DATA_BYTES_ENV = "OPTIMIZE_MAX_DATA_BYTES"


def max_data_bytes() -> int:
    value = os.environ.get(MAX_DATA_BYTES_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else MAX_DATA_BYTES


def check_data_file(path: str | None) -> Path:
    """A data file that exists and is a regular file (not a directory, FIFO, device or symbolic link)
    within the size limit; one DataError saying which it is otherwise."""
    if not path:
        raise DataError("this data source needs a path")
    p = Path(path).expanduser()
    try:
        info = os.lstat(p)
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist") from None
    except OSError as exc:
        raise DataError(f"data file {path}: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise DataError(f"data file {path} is a directory; give a file")
    if stat.S_ISLNK(info.st_mode):
        raise DataError(f"data file {path} is a symbolic link; give the file itself")
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(info.st_mode)
            else "a device"
            if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
            else "not a regular file"
        )
        raise DataError(f"data file {path} is {kind}; give a regular file")
    limit = max_data_bytes()
    if info.st_size > limit:
        raise DataError(
            f"data file {path} is {info.st_size} bytes, over the limit of {limit} "
            f"(set {MAX_DATA_BYTES_ENV} to raise it)"
        )
    return p


def _read(path: str | None) -> bytes:
    """The file's bytes, at most the size limit (a file that grows while read is refused too)."""
    p = check_data_file(path)
    limit = max_data_bytes()
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise DataError(f"data file {path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise DataError(f"data file {path} is over the limit of {limit} bytes (set {MAX_DATA_BYTES_ENV} to raise it)")
    return data


def names() -> list[str]:
    return sorted(_SOURCES)


# Options that describe where the data came from, recorded in the manifest when set.
_RECORDED = ("path", "dataset_split", "shape")


def load(name: str, split: str, count: int, seed: int, **options) -> TextSet:
    """Draw `count` items of a split with a seed. Raises DataError if the source cannot give them:
    never an empty set, never random data unless the source named is `random`."""
    if name in (None, "none", ""):
        raise DataError("no data source is set (calibration.source=none), but this recipe needs data")
    if name not in _SOURCES:
        raise DataError(f"unknown data source {name!r} (known: {', '.join(names())})")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (use {' or '.join(SPLITS)})")
    if count < 1:
        raise DataError(f"data source {name}: count={count}, but this recipe needs at least one {split} item")
    try:
        found = _SOURCES[name](split=split, count=count, seed=seed, **options)
    except DataError:
        raise
    except Exception as exc:  # readers raise many types (OSError, ArrowInvalid, ValueError...): all mean unreadable
        raise DataError(f"cannot read data source {name}: {type(exc).__name__}: {_first_line(exc)}") from None
    items, labels = (found.items, found.labels) if isinstance(found, Labeled) else (found, None)
    made = found.extra if isinstance(found, Labeled) else {}
    if not len(items):
        raise DataError(f"data source {name} ({split} split) is empty")
    if count > len(items):
        raise DataError(f"data source {name} has {len(items)} {split} items, the recipe asks for {count}")
    chosen = random.Random(seed).sample(range(len(items)), count)
    extra = {k: v for k, v in options.items() if k in _RECORDED and v}
    extra.update(made)
    if options.get("path"):
        extra["field"] = options.get("field")
    if name == "random":
        extra["random"] = True
        extra["note"] = "synthetic random data, asked for by name: scales do not reflect real inputs"
    return TextSet(
        name,
        split,
        seed,
        [items[i] for i in chosen],
        available=len(items),
        extra=extra,
        labels=[labels[i] for i in chosen] if labels is not None else None,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "unreadable"


def remove_overlap(calibration: TextSet, evaluation: TextSet, policy: str) -> TextSet:
    """Evaluation must not see calibration items. Policy 'error' refuses; 'drop' removes and records."""
    seen = set(calibration.item_hashes)
    keep_index = [i for i, h in enumerate(evaluation.item_hashes) if h not in seen]
    keep = [evaluation.items[i] for i in keep_index]
    overlap = len(evaluation.items) - len(keep)
    if overlap and policy != "drop":
        raise DataError(
            f"{overlap} evaluation items also appear in the calibration data (set evaluate.overlap=drop to remove them)"
        )
    if overlap and not keep:
        raise DataError("every evaluation item also appears in the calibration data")
    evaluation.items = keep
    if evaluation.labels is not None:
        evaluation.labels = [evaluation.labels[i] for i in keep_index]
    evaluation.dropped_overlap = overlap
    return evaluation


# Sources in their own modules register themselves on import (their heavy imports stay inside functions).
from calibration import files, images, labeled, media, synthetic  # noqa: E402,F401
