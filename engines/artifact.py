"""Reading and verifying artifact directories.

An artifact is a directory with `manifest.json`. This module only reads: it is shared by the
pipeline (which writes artifacts, see optimize/artifact.py) and by serve/ (which must not import
torch or the pipeline), so it depends on the standard library alone.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
_CHUNK = 1 << 20


class ArtifactError(Exception):
    """An artifact is missing, malformed, or does not match its manifest."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(root: Path) -> list[Path]:
    """Every regular file under root except the manifest, in a stable order."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_table(root: Path) -> list[dict]:
    """[{path, bytes, sha256}] for every file of the artifact (paths relative, POSIX style)."""
    return [
        {"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in list_files(root)
    ]


def read_manifest(root: str | Path) -> dict:
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{root} is not an artifact: no {MANIFEST}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(f"{path}: schema_version {version!r}, this version reads {SCHEMA_VERSION}")
    return manifest


def verify(root: str | Path) -> list[str]:
    """Compare every file with the manifest. Returns the problems found (empty: all good)."""
    root = Path(root)
    manifest = read_manifest(root)
    recorded = {f["path"]: f for f in manifest.get("files", [])}
    problems = []
    for rel, entry in recorded.items():
        path = root / rel
        if not path.is_file():
            problems.append(f"missing file {rel}")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"changed file {rel} (sha256 differs from the manifest)")
    on_disk = {p.relative_to(root).as_posix() for p in list_files(root)}
    problems += [f"unexpected file {rel} (not in the manifest)" for rel in sorted(on_disk - set(recorded))]
    return problems


class EngineUnavailable(ArtifactError):
    """The artifact is sound but this machine cannot run its engine (missing CPU feature, runtime)."""
