"""Reading and verifying artifact directories: the one checker `optimize.verify` and serve/ share.

An artifact is a directory with `manifest.json`. This module only reads (and seals a manifest the
pipeline is about to write, see optimize/artifact.py): serve/ must not import torch or the
pipeline, so it depends on the standard library alone.

What is checked, before anything opens a file the manifest names:
- the manifest is a JSON object of the expected shape (a malformed one is an ArtifactError, never
  a traceback), and its `integrity.digest` is the sha256 of its own canonical JSON, so an edited
  manifest (a flipped `gate.passed`, changed metrics) is refused;
- with a key, its signature: HMAC-SHA256 over the digest (stdlib). Ed25519 is not implemented:
  the `cryptography` package is not a dependency here;
- every path it holds (`files[].path`, the engine's `file`/`dir`/`tokenizer`/`model_dir`) is
  relative, has no `..`, and resolves inside the artifact through no symbolic link;
- every entry on disk is a regular file with one link (symlinks, hard links, FIFOs, sockets and
  devices are refused: a symlink or a hard link lets content outside the artifact stand in for
  it, and a FIFO blocks a reader forever), and matches its recorded sha256;
- the external-data locations of every ONNX graph (read from the protobuf here, not left to
  onnx or ONNX Runtime) are files beside the graph, inside the artifact, checked as above.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import re
import stat
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.json"
SCHEMA_VERSION = 2  # 2: the manifest carries `integrity` (its own digest, optionally signed)
INTEGRITY = "integrity"
SIGNING_KEY_ENV = "ARTIFACT_SIGNING_KEY"  # the pipeline signs with this key (a file holding the HMAC secret)
VERIFY_KEY_ENV = "ARTIFACT_VERIFY_KEY"  # verify and serve check with this one when --key is not given
HMAC_SCHEME = "hmac-sha256"
ENGINE_PATH_KEYS = ("file", "dir", "tokenizer", "model_dir")
MAX_MANIFEST_BYTES = 64 << 20
MAX_KEY_BYTES = 64 << 10
_CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ArtifactError(Exception):
    """An artifact is missing, malformed, or does not match its manifest."""


class EngineUnavailable(ArtifactError):
    """The artifact is sound but this machine cannot run its engine (missing CPU feature, runtime)."""


# --- JSON from outside: one parse for manifests and request bodies -------------------------------

MAX_JSON_INT_DIGITS = 64  # no field here needs more; Python refuses over 4300 digits with a ValueError


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONG_DIGITS = re.compile(r"[0-9]{%d}" % (MAX_JSON_INT_DIGITS + 1))


class JSONInputError(ValueError):
    """Text from outside that is not JSON this project accepts; the message is one line."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise JSONInputError(f"an integer of {len(text)} characters (at most {MAX_JSON_INT_DIGITS} digits)")
    return int(text)


def _check_strings(value) -> None:
    """Every string (key or value) must be encodable as UTF-8: a JSON escape can spell a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise JSONInputError("a string is not valid UTF-8 (a lone surrogate)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_json(data: bytes | str) -> object:
    """JSON from a file or a request, parsed strictly: UTF-8 only (raw surrogate bytes included, which
    `json.loads(bytes)` lets through), integers of at most MAX_JSON_INT_DIGITS digits, no lone
    surrogates, bounded nesting. NaN and Infinity stay readable (callers that take numbers check them).
    Anything else is a JSONInputError with one line."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        # The integer hook runs in Python once per integer (4x slower on a body of 12k integers):
        # only text holding a run of digits longer than the bound needs it.
        hook = _bounded_int if _LONG_DIGITS.search(text) else None
        value = json.loads(text, parse_int=hook)
    except UnicodeDecodeError as exc:
        raise JSONInputError(f"not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise JSONInputError(" ".join(str(exc).split())[:200]) from None
    except RecursionError:
        raise JSONInputError("nested too deeply") from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape can spell a lone surrogate: walk only then
        _check_strings(value)
    return value


# --- files: regular, one link, no symlink on the way ----------------------------------------------


def describe_kind(mode: int) -> str | None:
    """None for a regular file, else what it is (in words)."""
    if stat.S_ISREG(mode):
        return None
    for test, word in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def check_regular_file(path: Path, what: str | None = None) -> os.stat_result:
    """lstat `path`: it must be a regular file with a single link (not a symlink, hard link, FIFO or device)."""
    name = what or str(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ArtifactError(f"{name} does not exist") from None
    except OSError as exc:
        raise ArtifactError(f"{name}: cannot read ({exc.strerror})") from None
    kind = describe_kind(info.st_mode)
    if kind:
        raise ArtifactError(f"{name} is {kind}, not a regular file; refused")
    if info.st_nlink > 1:
        raise ArtifactError(f"{name} is a hard link ({info.st_nlink} names for one file); refused")
    return info


def sha256_file(path: Path) -> str:
    """sha256 of a regular file, opened without following a symlink and without blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ArtifactError(f"{path} is not a regular file; refused")
        digest = hashlib.sha256()
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_relative(rel: object, what: str) -> PurePosixPath:
    """A manifest path: a non-empty relative POSIX string with no `..`, backslash or NUL."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise ArtifactError(f"{what}={rel!r} is not a relative path")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or re.match(r"^[A-Za-z]:", rel):
        raise ArtifactError(f"{what}={rel!r} points outside the artifact; refused")
    return pure


def contained(root: Path, rel: object, what: str) -> Path:
    """root/rel, refused unless it stays inside root through no symbolic link (existing parts only)."""
    pure = check_relative(rel, what)
    path = Path(root)
    for part in pure.parts:
        if part == ".":
            continue
        path = path / part
        if os.path.islink(path):
            raise ArtifactError(f"{what}={rel!r}: {part!r} is a symbolic link; refused")
    base = Path(root).resolve()
    if path.resolve() != base and base not in path.resolve().parents:
        raise ArtifactError(f"{what}={rel!r} points outside the artifact; refused")
    return path


def walk(root: Path) -> list[str]:
    """Every entry under root except the manifest, as relative POSIX paths of regular files, in a stable
    order; any symlink, hard link, FIFO, socket or device is an ArtifactError."""
    root = Path(root)
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs):
            if os.path.islink(os.path.join(folder, name)):
                rel = Path(folder, name).relative_to(root).as_posix()
                raise ArtifactError(f"{root}: {rel} is a symbolic link to a directory; refused")
        for name in files:
            path = Path(folder, name)
            rel = path.relative_to(root).as_posix()
            if rel in (MANIFEST, MANIFEST + ".tmp") and folder == str(root):
                continue
            check_regular_file(path, f"{root}: {rel}")
            found.append(rel)
    return sorted(found)


def list_files(root: Path) -> list[Path]:
    """Every regular file under root except the manifest, in a stable order (special files refused)."""
    return [Path(root) / rel for rel in walk(root)]


def file_table(root: Path) -> list[dict]:
    """[{path, bytes, sha256}] for every file of the artifact (paths relative, POSIX style)."""
    root = Path(root)
    return [
        {"path": rel, "bytes": os.lstat(root / rel).st_size, "sha256": sha256_file(root / rel)} for rel in walk(root)
    ]


# --- the manifest: shape, digest, signature --------------------------------------------------------


def canonical(manifest: dict) -> bytes:
    """The bytes the digest covers: the manifest without `integrity`, sorted keys, compact, ASCII."""
    body = {k: v for k, v in manifest.items() if k != INTEGRITY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


def digest_of(manifest: dict) -> str:
    return hashlib.sha256(canonical(manifest)).hexdigest()


def read_key(source: str | Path) -> bytes:
    """The HMAC secret in a key file (surrounding whitespace dropped). The file must be a regular file
    of at most MAX_KEY_BYTES: /dev/zero or a FIFO named by mistake would otherwise be read forever."""
    try:
        fd = os.open(Path(source).expanduser(), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            kind = describe_kind(os.fstat(f.fileno()).st_mode)
            if kind:
                raise ArtifactError(f"key file {source} is {kind}, not a regular file")
            key = f.read(MAX_KEY_BYTES + 1).strip()
    except OSError as exc:
        raise ArtifactError(f"key file {source}: {exc.strerror or exc}") from None
    if len(key) > MAX_KEY_BYTES:
        raise ArtifactError(f"key file {source} is over {MAX_KEY_BYTES} bytes; an HMAC secret is short")
    if key.startswith(b"-----BEGIN"):
        raise ArtifactError(
            f"key file {source} holds a PEM key; Ed25519 needs the 'cryptography' package, "
            "which this installation does not use: give an HMAC secret"
        )
    if len(key) < 16:
        raise ArtifactError(f"key file {source}: an HMAC secret needs at least 16 bytes")
    return key


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"artifact-key-id:" + key).hexdigest()[:16]


def seal(manifest: dict, key: bytes | None = None) -> dict:
    """The manifest with its `integrity` block: the digest of its canonical JSON, signed with `key`.
    The manifest goes through JSON first, so what is digested is exactly what is written and read."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != INTEGRITY}, default=str))
    digest = digest_of(body)
    integrity: dict = {"algorithm": "sha256", "digest": digest}
    if key:
        integrity["signature"] = {
            "scheme": HMAC_SCHEME,
            "key_id": key_id(key),
            "value": hmac.new(key, digest.encode(), hashlib.sha256).hexdigest(),
        }
    return {**body, INTEGRITY: integrity}


def signing_key_from_env() -> bytes | None:
    path = os.environ.get(SIGNING_KEY_ENV)
    return read_key(path) if path else None


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


def check_signature(manifest: dict, key: bytes | None, require: bool = False) -> str:
    """'signed (...)', 'unsigned' or 'signature not checked'; a wrong signature, or a missing one when
    required, is an ArtifactError."""
    signature = manifest[INTEGRITY].get("signature")
    if signature is None:
        if require:
            raise ArtifactError("the manifest is not signed and a signature is required; refused")
        return "unsigned"
    if key is None:
        if require:
            raise ArtifactError(f"a signature is required but no key was given (--key or {VERIFY_KEY_ENV})")
        return "signature not checked (no key)"
    if signature["scheme"] != HMAC_SCHEME:
        raise ArtifactError(f"signature scheme {signature['scheme']!r} is not supported (only {HMAC_SCHEME})")
    expected = hmac.new(key, manifest[INTEGRITY]["digest"].encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, signature["value"]):
        raise ArtifactError("the manifest's signature does not match the key; refused")
    return f"signed ({HMAC_SCHEME}, key {key_id(key)})"


# --- ONNX external data, read from the protobuf -----------------------------------------------------


def _varint(buf, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, value or (start, end) of a length-delimited field)."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise ValueError("truncated field")
            yield number, wire, (pos, pos + size)
            pos += size
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != end:
        raise ValueError("truncated message")


# Which length-delimited fields of which message hold which messages (onnx.proto3).
_CHILDREN = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "function": {7: "node"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
}


def onnx_external_locations(path: Path) -> list[str]:
    """The external-data `location` of every tensor in an ONNX file (subgraphs included)."""
    locations: list[str] = []
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ArtifactError(f"{path} is empty, not an ONNX model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                _collect(buf, 0, len(buf), "model", locations, 0)
            except (ValueError, IndexError, RecursionError) as exc:
                raise ArtifactError(f"{path} is not a valid ONNX model ({exc})") from None
    return locations


def _collect(buf, start: int, end: int, kind: str, out: list[str], depth: int) -> None:
    if depth > 64:
        raise ValueError("nested too deeply")
    if kind == "tensor":
        for number, wire, value in _fields(buf, start, end):
            if number == 13 and wire == 2:  # external_data: StringStringEntryProto {key=1, value=2}
                entry = {
                    n: bytes(buf[v[0] : v[1]]).decode("utf-8", "replace") for n, w, v in _fields(buf, *value) if w == 2
                }
                if entry.get(1) == "location":
                    out.append(entry.get(2, ""))
        return
    children = _CHILDREN[kind]
    for number, wire, value in _fields(buf, start, end):
        if wire == 2 and number in children:
            _collect(buf, value[0], value[1], children[number], out, depth + 1)


def check_onnx_external_data(model: Path) -> list[Path]:
    """The external-data files of an ONNX graph, each refused unless it is a regular single-link file in
    the graph's own folder tree, reached through no symbolic link and no `..` (so a graph inside an
    artifact never reads outside it)."""
    files = []
    for location in sorted(set(onnx_external_locations(model))):
        what = f"{model.name}: external data location"
        path = contained(model.parent, location, what)
        check_regular_file(path, f"{what} {location!r}")
        files.append(path)
    return files


# --- the whole check ------------------------------------------------------------------------------


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
