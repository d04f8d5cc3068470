"""Held-out texts of more than one kind for token-level fidelity (optimize/evaluate/token_fidelity.py),
all installed with Python itself, so they read offline and alike on every machine with its version:
- prose: the pydoc topics' evaluation split (cpython_docs; calibration never draws it);
- code: the Python sources of the standard library's modules in the evaluation split (the same
  one-in-four hash of the module's path that python_docstrings uses, so no calibration set drawn from
  the library's docstrings shares a module with them). Test suites are left out.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

from calibration import DataError, _in_split, cpython_docs

KINDS = ("prose", "code")
_SKIPPED = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_CODE_CHARS = 400_000  # far more than 16k tokens need; reading stops here


@functools.lru_cache(maxsize=4)
def text_of(kind: str) -> str:
    if kind == "prose":
        return "\n\n".join(cpython_docs("evaluation"))
    if kind == "code":
        return _stdlib_code()
    raise DataError(f"unknown fidelity text kind {kind!r}: choose from {list(KINDS)}")


def _stdlib_code() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED & set(relative.parts) or not _in_split(str(relative), "evaluation"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(f"# {relative.as_posix()}\n{source}")
        size += len(source)
        if size >= _CODE_CHARS:
            break
    return "\n\n".join(parts)
