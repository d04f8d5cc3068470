"""Verified cache folders (OPTIMIZE_CACHE/race/, gguf/, export/): the cache is untrusted input.

Whoever can write the cache (another user, another node sharing it, a half-finished run) could put
any model there, so a cached folder is used only when it checks out against the record sealed into it
when it was built:
- every file's sha256, and no file more or less (regular files only: no links, FIFOs or devices);
- the code that built it (this project's sources and the installed packages, `code_fingerprint`);
- what it was built from (`source`: the caller's content hash of the inputs);
- an HMAC of all that with the cache key, a secret kept outside the cache (`OPTIMIZE_CACHE_KEY`, or
  a file created on first use under ~/.config/optimize/), so a record rewritten to match changed
  files does not pass either. A key file that group or others can access, that another user owns or
  that sits inside the cache is refused in one line (engines.cache.CacheKeyError, exit 2).
Anything else is rebuilt, and `open_verified` says why. Folders are built in a staging folder unique
to the run and renamed into place, so runs sharing one cache never see each other's half-built files.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

# The key's reading and the records' HMAC are the engines' too (the native kernels' compiled library is
# sealed with them): one implementation, in engines/cache.py.
from engines.cache import KEY_ENV, cache_key
from engines.cache import key_path as _key_path
from engines.cache import signature as _signature

log = logging.getLogger(__name__)
RECORD = "cache-record.json"
SCHEME = "optimize-cache-v1"
MAX_RECORD_BYTES = 1 << 20


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """The sha256 of this project's Python sources (the packages that build anything) and the installed
    package versions: a folder built by other code is rebuilt."""
    import engines
    import optimize
    from optimize.environment import package_versions

    digest = hashlib.sha256(json.dumps(package_versions(), sort_keys=True).encode())
    for package in (optimize, engines):
        root = Path(str(package.__file__)).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root.parent).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _files(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under folder but the record; ValueError for anything
    that is not a regular single-link file (a link could point anywhere)."""
    from engines.artifact import ArtifactError, sha256_file
    from engines.artifact.files import check_regular_file

    found = {}
    for parent, dirs, names in os.walk(folder, followlinks=False):
        for name in dirs:
            if os.path.islink(os.path.join(parent, name)):
                raise ValueError(f"{Path(parent, name).relative_to(folder).as_posix()} is a symbolic link")
        for name in names:
            path = Path(parent, name)
            rel = path.relative_to(folder).as_posix()
            if rel == RECORD:
                continue
            try:
                check_regular_file(path, rel)
            except ArtifactError as exc:
                raise ValueError(str(exc)) from None
            found[rel] = sha256_file(path)
    return dict(sorted(found.items()))


def staging(folder: Path) -> Path:
    """A new empty folder beside `folder`, unique to this call (two runs never share one)."""
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    tmp.mkdir(parents=True)
    return tmp


def open_verified(folder: Path, source: str) -> tuple[bool, str]:
    """(True, "") when `folder` holds exactly what its record says, built by this code from `source`;
    otherwise (False, why) — "not cached" when there is nothing there."""
    record_path = folder / RECORD
    if not os.path.lexists(folder):
        return False, "not cached"
    try:
        if record_path.is_symlink() or not record_path.is_file():
            return False, "it has no cache record"
        if record_path.stat().st_size > MAX_RECORD_BYTES:
            return False, "its cache record is oversized"
        record = json.loads(record_path.read_text())
        body, signature = record["body"], record["signature"]
        if not isinstance(body, dict) or not isinstance(signature, str):
            raise TypeError("malformed")
    except (OSError, ValueError, KeyError, TypeError):
        return False, "its cache record is unreadable"
    key = cache_key()
    if key is None:
        return False, f"no cache key could be read or made ({_key_path()})"
    if not hmac.compare_digest(signature, _signature(key, body)):
        return False, f"its cache record is not signed with this machine's cache key ({KEY_ENV})"
    if body.get("scheme") != SCHEME or body.get("code") != code_fingerprint():
        return False, "it was built by another version of this code or its packages"
    if body.get("source") != source:
        return False, "it was built from another source"
    try:
        files = _files(folder)
    except (OSError, ValueError) as exc:
        return False, f"it holds a file that is not a regular file ({exc})"
    if files != body.get("files"):
        recorded: dict = body["files"] if isinstance(body.get("files"), dict) else {}
        changed = sorted(set(files) ^ set(recorded) | {p for p in files if recorded.get(p) not in (None, files[p])})
        return False, f"its files differ from those it was built with ({', '.join(changed[:5])})"
    return True, ""


def seal(tmp: Path, folder: Path, source: str) -> Path:
    """Record the staged folder `tmp` (its files' hashes, this code, `source`, signed) and move it to
    `folder`. A folder already there that verifies (another run built the same) is kept and `tmp`
    dropped; one that does not is replaced. Returns `folder`."""
    key = cache_key()
    body = {"scheme": SCHEME, "code": code_fingerprint(), "source": source, "files": _files(tmp)}
    signature = _signature(key, body) if key else ""
    (tmp / RECORD).write_text(json.dumps({"body": body, "signature": signature}, sort_keys=True))
    for _ in range(5):
        try:
            os.rename(tmp, folder)
            return folder
        except OSError:  # something is there: keep it if it is good, else move it aside and retry
            if open_verified(folder, source)[0]:
                shutil.rmtree(tmp, ignore_errors=True)
                return folder
            discard(folder)
    raise OSError(f"cannot place {folder}: other runs keep replacing it")


def discard(folder: Path) -> None:
    """Remove a cached folder that failed its check: renamed aside first (atomic, so a run reading it
    never sees it half-deleted by another), then deleted."""
    aside = folder.parent / f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.old"
    try:
        os.rename(folder, aside)
    except OSError:
        return  # gone already (another run moved it)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def verified_json(folder: Path, source: str, name: str, what: str, instead: str) -> dict | None:
    """The JSON object `name` of a cached folder that verifies (open_verified), else None: a folder
    there that fails its check, or whose `name` is not an object, is logged ("WHAT FOLDER not used,
    INSTEAD: why") and removed, to be built again."""
    good, why = open_verified(folder, source)
    if good:
        try:
            found = json.loads((folder / name).read_text())
            if isinstance(found, dict):
                return found
            why = f"its {name} is not an object"
        except (OSError, ValueError) as exc:
            why = f"its {name} is unreadable ({type(exc).__name__})"
    if why != "not cached":
        log.warning("%s %s not used, %s: %s", what, folder.name, instead, why)
        discard(folder)
    return None


def build_identity(model, ctx) -> str:
    """What a build from `model` is built from (the race's candidates, the checked ONNX export): the
    weights themselves (a pruned or distilled module's too), the calibration set, the package versions
    and the CPU features that change kernels."""
    from engines.hardware import CPU_FEATURES, cpu_flags
    from optimize.environment import package_versions

    what = {
        "weights": weights_hash(model),
        "task": model.task,
        "calibration": ctx.calibration().describe(),
        "max_length": ctx.plan.model.max_length,
        "packages": package_versions(),
        "cpu": sorted(f for f in CPU_FEATURES if f in cpu_flags()),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def weights_hash(model) -> str:
    import torch

    from engines.artifact import sha256_file

    if model.kind == "onnx":
        return sha256_file(model.onnx_path)
    digest = hashlib.sha256()
    for name, tensor in model.module.state_dict().items():
        digest.update(name.encode())
        # the raw bytes (numpy has no bfloat16): for FP32 weights the same bytes as tensor.numpy()
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
