"""Writing artifacts atomically.

A run builds its artifact in a hidden partial directory beside the destination,
`.NAME.partial-PID-RANDOM/`, which holds the artifact being built (`artifact/`) and the run's
scratch files (`scratch/`). The artifact is renamed into place only when its manifest is written,
so an interrupted run leaves no directory that looks like a finished artifact; the partial
directory (scratch included) is removed on any error, and one left by a killed run (SIGKILL runs
no cleanup) is removed by the next run into the same place once its PID is provably gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import stat
import uuid
from pathlib import Path

from engines.artifact import (
    MANIFEST,
    SCHEMA_VERSION,
    ArtifactError,
    file_table,
    read_manifest,
    seal,
    signing_key_from_env,
)
from optimize.errors import RecipeError

STAGE, SCRATCH = "artifact", "scratch"
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)-[0-9a-f]+$")


def check_destination(final: Path, overwrite: bool) -> None:
    """output_dir must be new, an empty directory, or (overwrite=true) an artifact; its parent writable."""
    if os.path.islink(final) or (final.exists() and not final.is_dir()):
        kind = "a symbolic link" if os.path.islink(final) else "a file, not a directory"
        raise RecipeError(f"output_dir={final} is {kind}; refusing to write or replace it")
    if final.exists() and any(final.iterdir()):
        if not overwrite:
            raise RecipeError(f"output_dir={final} already exists and is not empty (set overwrite=true to replace it)")
        if not (final / MANIFEST).is_file():
            raise RecipeError(f"output_dir={final} is not an artifact; refusing to replace it")
    ancestor = final.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RecipeError(f"output_dir={final}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RecipeError(f"output_dir={final}: {ancestor} is not writable")


def remove_dead_partials(final: Path) -> list[Path]:
    """Remove partial directories of `final` whose run is provably gone (its PID no longer exists)."""
    removed: list[Path] = []
    if not final.parent.is_dir():
        return removed
    for entry in final.parent.iterdir():
        match = _PARTIAL.match(entry.name)
        if not match or match["name"] != final.name or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(match["pid"])
        try:
            os.kill(pid, 0)
            continue  # alive (or a PID reused by another process): not provably dead, keep it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # exists, owned by someone else
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


@contextlib.contextmanager
def staging(final: Path):
    """Yield a fresh directory for the artifact; it lives in a hidden partial directory beside `final`
    (with the run's scratch, see scratch_for) that is deleted unless `publish` moved the artifact out."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_partials(final)
        partial = final.parent / f".{final.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        partial.mkdir()
    except OSError as exc:
        raise RecipeError(f"output_dir={final}: cannot create it ({exc.strerror})") from None
    stage = partial / STAGE
    stage.mkdir()
    try:
        yield stage
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def scratch_for(stage: Path) -> Path:
    """The run's scratch folder, beside the artifact inside the partial directory (removed with it)."""
    scratch = stage.parent / SCRATCH
    scratch.mkdir(exist_ok=True)
    return scratch


def write_manifest(stage: Path, manifest: dict) -> dict:
    """Fill in schema version and the file table (every file with its sha256), seal it (its digest,
    signed with the key ARTIFACT_SIGNING_KEY names, if set), then write."""
    try:
        key = signing_key_from_env()
        manifest = seal(json_safe({"schema_version": SCHEMA_VERSION, **manifest, "files": file_table(stage)}), key)
    except ArtifactError as exc:
        raise RecipeError(str(exc)) from None
    tmp = stage / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False, allow_nan=False) + "\n")
    os.replace(tmp, stage / MANIFEST)
    return manifest


def json_safe(value):
    """`value` with every non-finite float as null: NaN and inf are not JSON, and a manifest that
    holds them (a metric a diverged candidate measured) could not be read by a strict parser. The
    recipe's numbers are finite already (optimize/plan.py refuses the rest)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def publish(stage: Path, final: Path) -> None:
    """Move the finished stage into place; an old artifact (overwrite=true) is removed only now."""
    if os.path.lexists(final) and not stat.S_ISDIR(os.lstat(final).st_mode):
        raise RecipeError(f"output_dir={final} became a file or link during the run; the artifact was not written")
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(stage, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, final)


# What a run's identity does not depend on: where the artifact goes, not what it is.
NOT_IDENTITY = ("output_dir", "overwrite", "report", "publish")


def content_id(recipe: dict, source_sha256: dict, stage: Path) -> str:
    """The artifact's id: sha256 over the recipe (less where its outputs go), the source's file hashes
    and every file built so far (the engine, its tokenizer, plots); the same inputs building the same
    bytes get the same id."""
    identity = {
        "recipe": {k: v for k, v in recipe.items() if k not in NOT_IDENTITY},
        "source": source_sha256,
        "files": {f["path"]: f["sha256"] for f in file_table(stage)},
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def parent_id(source_location: str, source_sha256: dict) -> str | None:
    """What the artifact came from: the id of the artifact its source file lies in (a model taken from
    an earlier artifact), else the content hash of the source's weight files (None when it has none)."""
    location = Path(source_location)
    for folder in (location, *location.parents)[:3]:
        if (folder / MANIFEST).is_file():
            try:
                return read_manifest(folder)["id"]
            except ArtifactError:
                break  # not a readable artifact: identify the source by its own bytes
    if not source_sha256:
        return None
    return hashlib.sha256(json.dumps(source_sha256, sort_keys=True).encode()).hexdigest()
