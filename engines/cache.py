"""Where the pipeline and its engines keep what they build once per machine ($OPTIMIZE_CACHE, else
~/.cache/optimize)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("OPTIMIZE_CACHE") or Path.home() / ".cache" / "optimize").expanduser()
