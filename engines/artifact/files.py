"""Files of an artifact: regular, one link, no symbolic link on the way, paths that stay inside."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path, PurePosixPath

from .errors import ArtifactError

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


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
