"""Every module of the code packages (benchmarks included) imports (in the fast tier): a module no fast test reaches,
such as one only a slow end-to-end test runs, still fails `make test-fast` when an import in it
breaks (a moved module, a renamed name, a missing dependency at import time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("optimize", "engines", "calibration", "serve", "benchmarks")
# Scripts shipped inside every bundle and run there by their path, never imported as project modules
# (tests/optimize/test_architecture.py lists them with why).
NOT_MODULES = ("optimize/assets/",)

# Each module imported in turn in a fresh interpreter, so what one module's import does (a registry
# filled, a library's settings changed) stays out of the test process; one line per failure.
IMPORT_EACH = """
import importlib, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        print(f"{name}: {line}")
"""


def module_names() -> list[str]:
    """The modules as the files on disk name them (not as pkgutil finds them: it skips a folder that
    lacks its `__init__.py`, and every module below it)."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if "__pycache__" in relative.parts or relative.as_posix().startswith(NOT_MODULES):
                continue
            parts = relative.with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_of_the_code_packages_imports():
    names = module_names()
    assert len(names) > 100 and "serve.app" in names and "optimize.pipeline" in names
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *names], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "", f"modules that do not import:\n{proc.stdout}"
