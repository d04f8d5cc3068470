"""The build cache: a built candidate is kept under the hash of what it was built from (the
weights, the calibration set, the package versions, the CPU, its own methods and parameters), so a
rerun with another gate rebuilds nothing. Causal LMs also keep the PyTorch baseline's scores and
timings (baseline_key), so a rerun on the same model, machine and shapes does not measure it again.

The cache is untrusted input (optimize/cache_store.py): a cached candidate is used only when its
files match the signed record written when it was built, by this code, from this key; anything
else (a swapped model.onnx, an edited or corrupt candidate.json) is rebuilt, with the reason."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from engines.onnxruntime.export import copy_onnx
from optimize import cache_store
from optimize.compile.race.candidates import Candidate

log = logging.getLogger(__name__)


def key_of(key_base: str, spec: Candidate) -> str:
    """What the candidate built to `spec` from what `key_base` hashes is built from (its cache key)."""
    return hashlib.sha256((key_base + json.dumps(asdict(spec), sort_keys=True)).encode()).hexdigest()


def folder(key_base: str, spec: Candidate) -> Path:
    """Where the candidate built to `spec` from what `key_base` hashes is kept."""
    from optimize.sources.models import cache_root

    return cache_root() / "race" / key_of(key_base, spec)[:24]


def save(model, records: dict, folder: Path, source: Optional[str] = None):
    """Move a built candidate's engine files into `folder`: through a staging folder of this run and a
    sealed record when `source` is given (the cache), else straight there (the run's scratch)."""
    if source is None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return _model_from(folder, _write(model, records, folder), model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_store.staging(folder)
    try:
        saved = _write(model, records, tmp)
        cache_store.seal(tmp, folder, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _model_from(folder, saved, model)


def _write(model, records: dict, into: Path) -> dict:
    """The candidate's engine files and its candidate.json in `into`; returns what candidate.json says."""
    if model.kind == "onnx":
        copy_onnx(model.onnx_path, into)
        saved: dict[str, Any] = {"kind": "onnx", "file": "model.onnx"}
    else:
        shutil.copytree(model.engine_dir, into, dirs_exist_ok=True)
        saved = {"kind": "engine"}
    saved.update(engine=model.engine, precision=model.precision, layer_precision=model.layer_precision, records=records)
    (into / "candidate.json").write_text(json.dumps(saved, default=str))
    return saved


def load_cached(key_base: str, spec: Candidate, exported) -> tuple[Any, dict, str]:
    """(model, records, "") of the cached candidate when it verifies, else (None, {}, why not): a
    folder there that fails its check is removed, to be rebuilt."""
    where = folder(key_base, spec)
    good, why = cache_store.open_verified(where, key_of(key_base, spec))
    if good:
        try:
            saved = json.loads((where / "candidate.json").read_text())
            return _model_from(where, saved, exported), saved["records"], ""
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # signed, yet not ours
            why = f"its candidate.json does not describe a candidate ({type(exc).__name__})"
    if why != "not cached":
        log.warning("race: cached candidate %s not used, rebuilt: %s", where.name, why)
        cache_store.discard(where)
    return None, {}, why


def _model_from(folder: Path, saved: dict, template):
    if saved["kind"] == "onnx":
        model = template.with_onnx(folder / saved["file"], precision=saved["precision"])
        model.engine.update(saved["engine"], file=saved["file"])
    else:
        model = template.with_engine(folder, saved["engine"], precision=saved["precision"])
    return dataclasses.replace(model, layer_precision=saved.get("layer_precision") or {})


def baseline_key(key_base: str, what: dict) -> str:
    """The key of a baseline's figures: what the candidates are built from (key_base: the weights, the
    package versions, the CPU) and what they were measured on (`what`: data, shapes, runs, threads)."""
    return hashlib.sha256((key_base + json.dumps(what, sort_keys=True, default=str)).encode()).hexdigest()[:24]


def _baseline_folder(key: str) -> Path:
    from optimize.sources.models import cache_root

    return cache_root() / "race" / f"baseline-{key}"


def load_baseline(key: str) -> dict | None:
    """The baseline's cached figures when their folder verifies like a candidate's (a figure edited
    in the cache would move every speedup), else None; a folder that fails its check is removed."""
    folder = _baseline_folder(key)
    return cache_store.verified_json(folder, key, "figures.json", "race: cached baseline figures", "measured again")


def save_baseline(key: str, figures: dict) -> None:
    where = _baseline_folder(key)
    tmp = cache_store.staging(where)
    (tmp / "figures.json").write_text(json.dumps(figures))
    cache_store.seal(tmp, where, key)
