"""Where the pipeline and its engines keep what they build once per machine ($OPTIMIZE_CACHE, else
~/.cache/optimize), and the secret that seals what is kept there.

The cache is untrusted input (anyone who shares the folder can write it), so what is taken from it is
checked against a record signed with the cache key: an HMAC-SHA256 secret kept outside the cache
(`OPTIMIZE_CACHE_KEY` names its file, else ~/.config/optimize/cache.key under $XDG_CONFIG_HOME,
created mode 0600 on first use). optimize/cache_store.py (the race's and the GGUF conversion's
folders) and engines/native_gguf/build.py (the compiled kernels) both read it here: one reading,
one signature.

A key file others could read or write is no secret, and one inside the cache is written by whoever
writes the cache: both are refused in one line (CacheKeyError), as ssh refuses a private key that
group or others can read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import uuid
from pathlib import Path
from typing import Optional

from engines.artifact import ArtifactError

KEY_ENV = "OPTIMIZE_CACHE_KEY"


class CacheKeyError(ArtifactError):
    """The cache key file is unsafe to trust (one line: who else can read or write it, or where it is).
    An ArtifactError, so the pipeline's command line says it in one line and exits 2."""


def cache_root() -> Path:
    return Path(os.environ.get("OPTIMIZE_CACHE") or Path.home() / ".cache" / "optimize").expanduser()


def key_path() -> Path:
    configured = os.environ.get(KEY_ENV)
    if configured:
        return Path(configured).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser()
    return base / "optimize" / "cache.key"


def _create_whole(path: Path, text: str) -> None:
    """Create `path` holding `text`, or raise FileExistsError: written under a private name first and
    linked into place, so a run starting at the same moment never reads it empty or half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.link(tmp, path)  # fails when it exists: the first run's key is everyone's
    finally:
        os.unlink(tmp)


def unsafe_key_file(path: Path) -> Optional[str]:
    """Why the key file at `path` cannot be trusted, or None (also None where it cannot be stat'ed:
    reading it then fails with its own reason). Root may own it (a mounted secret); nobody else but
    this user may, and neither group nor others may have any access."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    if _inside(path, cache_root()):
        return (
            f"cache key file {path} is inside the cache ($OPTIMIZE_CACHE={cache_root()}), which others may write; "
            f"keep it outside (${KEY_ENV})"
        )
    if found.st_uid not in (os.geteuid(), 0):
        return f"cache key file {path} is owned by another user (uid {found.st_uid}); it must be yours"
    if found.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"cache key file {path} is mode {stat.S_IMODE(found.st_mode):04o}: group or others can access it; "
            f"it must be private (chmod 600 {path})"
        )
    return None


def _inside(path: Path, folder: Path) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    except OSError:
        return False


def cache_key() -> Optional[bytes]:
    """The secret the cache records are signed with; created (mode 0600) when the default file is
    missing. None when it cannot be read or made: nothing cached is then trusted (everything is
    rebuilt). CacheKeyError (one line) when the file is there but unsafe to trust."""
    from engines.artifact.integrity import read_key

    path = key_path()
    if not os.path.lexists(path) and not os.environ.get(KEY_ENV):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _create_whole(path, secrets.token_hex(32))
        except FileExistsError:
            pass  # another run made it first
        except OSError:
            return None
    reason = unsafe_key_file(path)
    if reason:
        raise CacheKeyError(reason)
    try:
        return read_key(path)
    except ArtifactError:
        return None


def signature(key: bytes, body: dict) -> str:
    """The HMAC-SHA256 of a record's body (its canonical JSON) under the cache key."""
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()
