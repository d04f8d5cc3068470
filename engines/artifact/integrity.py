"""The manifest's integrity: the digest of its own canonical JSON, and an HMAC-SHA256 signature over it
(Ed25519 is not implemented: the `cryptography` package is not a dependency here)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from .errors import ArtifactError
from .files import describe_kind

INTEGRITY = "integrity"
SIGNING_KEY_ENV = "ARTIFACT_SIGNING_KEY"  # the pipeline signs with this key (a file holding the HMAC secret)
VERIFY_KEY_ENV = "ARTIFACT_VERIFY_KEY"  # verify and serve check with this one when --key is not given
HMAC_SCHEME = "hmac-sha256"
MAX_KEY_BYTES = 64 << 10


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
