"""Engines: exporters and builders, each giving a Runner.

A Runner is called on a batch of named numpy arrays and returns named numpy arrays (the interfaces
are written down in engines/runners.py). The same Runner is what the pipeline measures and what
serve/ runs. This package imports on a CPU-only machine without torch: each engine imports its
runtime inside the functions that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engines.artifact import ArtifactError, check_engine_paths, read_manifest
from engines.runners import TensorRunner

if TYPE_CHECKING:
    from engines.generation import GeneratingRunner


def load(artifact_dir: str | Path, threads: int = 0, spinning: bool = True) -> TensorRunner | GeneratingRunner:
    """Build the Runner an artifact's manifest describes (its `engine` block)."""
    root = Path(artifact_dir)
    engine = read_manifest(root).get("engine") or {}
    return load_engine(root, engine, threads=threads, spinning=spinning)


def load_engine(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> TensorRunner | GeneratingRunner:
    """The Runner of an engine block, through the engine table (engines/formats.py): a TensorRunner,
    which for a format that generates is a GeneratingRunner too (engines/generation.py).

    `spinning=False` for servers: idle runtime threads sleep instead of busy-waiting. The block's paths
    (`file`, `dir`, `tokenizer`, and an ONNX graph's external data) must resolve inside `root` through
    no symbolic link, and name regular single-link files, before any runtime opens them. (`model_dir`
    is the PyTorch baseline's source folder, outside any artifact; a manifest's is checked by
    read_manifest.)"""
    from engines import formats

    try:
        fmt = formats.get(engine.get("format"))
    except formats.UnknownFormat as exc:
        raise ArtifactError(f"{exc.args[0]} in {root}") from None
    check_engine_paths(Path(root), engine, keys=("file", "dir", "tokenizer"))
    return fmt.load(Path(root), engine, threads=threads, spinning=spinning)


def engine_bytes(root: Path, engine: dict) -> int:
    """Bytes on disk of an engine block's model: its `file` and the weights beside it (an ONNX graph's
    external data, OpenVINO's .bin), or every file under its `dir` but the tokenizer's. The race and
    the gate measure size with this, so a candidate is judged on the size the artifact reports."""
    from engines.artifact import onnx_external_locations

    root = Path(root)
    if "file" in engine:
        main = root / engine["file"]
        beside = onnx_external_locations(main) if main.suffix == ".onnx" else [main.with_suffix(".bin").name]
        weights = {main.parent / name for name in beside}
        return main.stat().st_size + sum(w.stat().st_size for w in weights if w.is_file())
    tokenizer = root / engine["tokenizer"] if engine.get("tokenizer") else None
    files = [p for p in (root / engine.get("dir", ".")).rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files if tokenizer is None or tokenizer not in p.parents)
