"""The manifest's shape, reading it (shape, paths, its own digest), and the whole check of an artifact
directory against it."""

from __future__ import annotations

import hmac
import os
import re
from pathlib import Path

from .errors import ArtifactError
from .files import MANIFEST, check_regular_file, check_relative, contained, sha256_file, walk
from .integrity import INTEGRITY, check_signature, digest_of
from .onnx_data import check_onnx_external_data
from .strict_json import JSONInputError, parse_json

SCHEMA_VERSION = 2  # 2: the manifest carries `integrity` (its own digest, optionally signed)
ENGINE_PATH_KEYS = ("file", "dir", "tokenizer", "model_dir")
MAX_MANIFEST_BYTES = 64 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _expect(value, kind, what: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ArtifactError(f"malformed manifest: {what} must be {names}, got {type(value).__name__}")
    return value


def check_shape(raw: object) -> dict:
    """The structure every reader relies on; a malformed manifest is one ArtifactError."""
    manifest: dict = _expect(raw, dict, "the manifest")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"schema_version {version!r}, this version reads {SCHEMA_VERSION}"
            + (" (rebuild the artifact)" if version == 1 else "")
        )
    files = _expect(manifest.get("files"), list, "files")
    seen = set()
    for i, entry in enumerate(files):
        _expect(entry, dict, f"files[{i}]")
        rel = check_relative(entry.get("path"), f"files[{i}].path")
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise ArtifactError(f"malformed manifest: files[{i}].sha256 must be 64 hex digits")
        if "bytes" in entry:
            _expect(entry["bytes"], int, f"files[{i}].bytes")
        if rel.as_posix() in seen or rel.as_posix() == MANIFEST:
            raise ArtifactError(
                f"malformed manifest: files[{i}].path {rel.as_posix()!r} is listed twice or is the manifest"
            )
        seen.add(rel.as_posix())
    engine = _expect(manifest.get("engine") or {}, dict, "engine")
    for key in ENGINE_PATH_KEYS:
        if engine.get(key) is not None:
            check_relative(engine[key], f"engine.{key}")
    gate = _expect(manifest.get("gate") or {}, dict, "gate")
    if "passed" in gate:
        _expect(gate["passed"], bool, "gate.passed")
    _expect(gate.get("checks", []), list, "gate.checks")
    integrity = _expect(manifest.get(INTEGRITY), dict, INTEGRITY)
    if not isinstance(integrity.get("digest"), str):
        raise ArtifactError("malformed manifest: integrity.digest is missing")
    if "signature" in integrity:
        signature = _expect(integrity["signature"], dict, "integrity.signature")
        for key in ("scheme", "value"):
            _expect(signature.get(key), str, f"integrity.signature.{key}")
    return manifest


def read_manifest(root: str | Path) -> dict:
    """The manifest, checked: shape, paths and its own digest (an edited manifest is refused here)."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory")
    if not os.path.lexists(path):
        raise ArtifactError(f"{root} is not an artifact: no {MANIFEST}")
    size = check_regular_file(path, str(path)).st_size
    if size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path} is {size} bytes, over the {MAX_MANIFEST_BYTES} a manifest may have")
    try:
        raw = parse_json(path.read_bytes())
    except JSONInputError as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
    try:
        manifest = check_shape(raw)
    except ArtifactError as exc:
        raise ArtifactError(f"{path}: {exc}") from None
    if not hmac.compare_digest(digest_of(manifest), manifest[INTEGRITY]["digest"]):
        raise ArtifactError(
            f"{path} was modified after it was written (its digest does not match its content); refused"
        )
    return manifest


def check_engine_paths(root: Path, engine: dict, keys: tuple[str, ...] = ENGINE_PATH_KEYS) -> None:
    """Every path of an engine block resolves inside root; its ONNX graphs' external data too."""
    for key in keys:
        if engine.get(key) is not None:
            path = contained(root, engine[key], f"engine.{key}")
            if key == "file":
                check_regular_file(path, f"engine.file={engine[key]!r}")
                if path.suffix == ".onnx":
                    check_onnx_external_data(path)


def verify(root: str | Path, key: bytes | None = None, require_signature: bool = False) -> list[str]:
    """Compare every file with the manifest. Returns the problems found (empty: all good).

    A malformed or edited manifest, an unsafe path or entry, or a bad signature raises ArtifactError:
    those are refusals, which no `--allow-modified` lifts."""
    root = Path(root)
    manifest = read_manifest(root)
    check_signature(manifest, key, require_signature)
    recorded = {f["path"]: f for f in manifest["files"]}
    on_disk = set(walk(root))  # refuses symlinks, hard links, FIFOs and devices anywhere in the tree
    problems = []
    for rel, entry in recorded.items():
        path = contained(root, rel, "files[].path")
        if rel not in on_disk:
            problems.append(f"missing file {rel}")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"changed file {rel} (sha256 differs from the manifest)")
    problems += [f"unexpected file {rel} (not in the manifest)" for rel in sorted(on_disk - set(recorded))]
    check_engine_paths(root, manifest.get("engine") or {})
    for rel in sorted(recorded):
        if rel.endswith(".onnx") and rel in on_disk:
            check_onnx_external_data(root / rel)
    return problems
