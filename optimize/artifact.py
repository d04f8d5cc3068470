"""Writing artifacts atomically.

A run builds its artifact in a hidden staging directory beside the destination and renames it
into place only when the manifest is written, so an interrupted run leaves no directory that
looks like a finished artifact; the staging directory is removed on any error.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

from engines.artifact import MANIFEST, SCHEMA_VERSION, file_table
from optimize.errors import RecipeError


def check_destination(final: Path, overwrite: bool) -> None:
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        if not overwrite:
            raise RecipeError(f"output_dir={final} already exists and is not empty (set overwrite=true to replace it)")
        if final.is_dir() and not (final / MANIFEST).is_file():
            raise RecipeError(f"output_dir={final} is not an artifact; refusing to replace it")


@contextlib.contextmanager
def staging(final: Path):
    """Yield a fresh directory beside `final`; it is deleted unless `publish` moved it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        yield stage
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def write_manifest(stage: Path, manifest: dict) -> dict:
    """Fill in schema version and the file table (every file with its sha256), then write."""
    manifest = {"schema_version": SCHEMA_VERSION, **manifest, "files": file_table(stage)}
    tmp = stage / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, stage / MANIFEST)
    return manifest


def publish(stage: Path, final: Path) -> None:
    """Move the finished stage into place; an old artifact (overwrite=true) is removed only now."""
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(stage, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, final)
