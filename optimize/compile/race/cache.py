"""The build cache: a built candidate is kept under the hash of what it was built from (the
weights, the calibration set, the package versions, the CPU, its own methods and parameters), so a
rerun with another gate rebuilds nothing. Causal LMs also keep the PyTorch baseline's scores and
timings (baseline_key), so a rerun on the same model, machine and shapes does not measure it again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engines.onnxruntime.export import copy_onnx
from optimize.compile.race.candidates import Candidate


def identity(model, ctx) -> str:
    """What every candidate is built from: the weights themselves (a pruned or distilled module's
    too), the calibration set, the package versions and the CPU features that change kernels."""
    from engines.hardware import CPU_FEATURES, cpu_flags
    from optimize.environment import package_versions

    what = {
        "weights": _weights_hash(model),
        "task": model.task,
        "calibration": ctx.calibration().describe(),
        "max_length": ctx.plan.model.max_length,
        "packages": package_versions(),
        "cpu": sorted(f for f in CPU_FEATURES if f in cpu_flags()),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _weights_hash(model) -> str:
    from engines.artifact import sha256_file

    if model.kind == "onnx":
        return sha256_file(model.onnx_path)
    digest = hashlib.sha256()
    for name, tensor in model.module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def folder(key_base: str, spec: Candidate) -> Path:
    """Where the candidate built to `spec` from what `key_base` hashes is kept."""
    from optimize.models import cache_root

    key = hashlib.sha256((key_base + json.dumps(asdict(spec), sort_keys=True)).encode()).hexdigest()[:24]
    return cache_root() / "race" / key


def save(model, records: dict, folder: Path):
    """Move a built candidate's engine files into `folder` (atomically when it is the cache)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if model.kind == "onnx":
        copy_onnx(model.onnx_path, tmp)
        saved: dict[str, Any] = {"kind": "onnx", "file": "model.onnx"}
    else:
        shutil.copytree(model.engine_dir, tmp, dirs_exist_ok=True)
        saved = {"kind": "engine"}
    saved.update(engine=model.engine, precision=model.precision, layer_precision=model.layer_precision, records=records)
    (tmp / "candidate.json").write_text(json.dumps(saved, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return _model_from(folder, saved, model)


def load_cached(folder: Path, exported):
    saved = json.loads((folder / "candidate.json").read_text())
    return _model_from(folder, saved, exported), saved["records"]


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


def load_baseline(key: str) -> dict | None:
    from optimize.models import cache_root

    path = cache_root() / "race" / f"baseline-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_baseline(key: str, figures: dict) -> None:
    from optimize.models import cache_root

    path = cache_root() / "race" / f"baseline-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(figures))
    tmp.replace(path)
