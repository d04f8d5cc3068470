"""A plugin module dropped beside a package's own modules, and a copy of recipes/ with its YAML:
what `test_new_method` and `test_new_task` use to prove a method or a task is one file plus one YAML."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

from optimize.__main__ import CONFIG_DIR


def install_plugin(tmp_path: Path, monkeypatch, package: ModuleType, name: str, source: str) -> Path:
    """Write `name`.py into its own directory on `package`'s path (undone after the test); returns a
    copy of recipes/ the caller adds its YAML to. The caller drops the imported module afterwards."""
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    (plugin_dir / f"{name}.py").write_text(source)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(plugin_dir)])
    recipes = tmp_path / "recipes"
    shutil.copytree(CONFIG_DIR, recipes, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return recipes
