"""The layers contract states the truth and holds everything: benchmarks above optimize above serve above
engines and calibration (which know nothing of each other). Every folder of Python code is a root
package of the contracts and sits in a layer, the tree as it is keeps every contract, and an import that
points up a layer, or across engines and calibration, breaks the layers contract by name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
LINTER = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
ROOTS: tuple[str, ...] = tuple(LINTER["root_packages"])
LAYERS = next(c for c in LINTER["contracts"] if c["type"] == "layers")
# Top-level folders of tracked Python that are not code the contracts judge, each with why.
NOT_CODE = {
    "tests": "the tests import every package to check it",
    "recipes": "Hydra's YAML, a package only so its files ship as package data",
}


def tracked(*paths: str) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True, text=True, check=True)
    return listed.stdout.split()


def layer_packages() -> list[set[str]]:
    """The layers contract's layers, top first, each the set of packages it holds."""
    return [{p.strip() for p in re.split(r"[:|]", layer)} for layer in LAYERS["layers"]]


def test_every_folder_of_python_code_is_a_root_package_in_a_layer():
    folders = {Path(f).parts[0] for f in tracked() if f.endswith(".py") and len(Path(f).parts) > 1}
    assert folders - set(NOT_CODE) == set(ROOTS), "a folder of code outside [tool.importlinter] root_packages"
    assert set().union(*layer_packages()) == set(ROOTS), "a root package in no layer of the layers contract"
    acyclic = next(c for c in LINTER["contracts"] if c["type"] == "acyclic_siblings")
    assert set(acyclic["ancestors"]) == set(ROOTS)


def test_the_layers_are_the_order_the_packages_import_in():
    assert layer_packages() == [{"benchmarks"}, {"optimize"}, {"serve"}, {"engines", "calibration"}]


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    """The root packages' tracked files and pyproject.toml, in a folder of their own."""
    root = tmp_path_factory.mktemp("layers")
    for path in tracked(*ROOTS):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / path, root / path)
    shutil.copyfile(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(script) if script.exists() else "lint-imports", "--no-cache", "--no-logo"],
        cwd=root,
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_as_it_is_keeps_every_contract(tree_copy):
    proc = lint_imports(tree_copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{LAYERS['name']} KEPT" in proc.stdout


@pytest.mark.parametrize(
    "module, line, importer, imported",
    [
        ("engines/text.py", "import optimize.errors", "engines.text", "optimize.errors"),
        ("engines/cache.py", "import serve.errors", "engines.cache", "serve.errors"),
        ("serve/errors.py", "import optimize.errors", "serve.errors", "optimize.errors"),
        ("optimize/errors.py", "import benchmarks.artifact_input", "optimize.errors", "benchmarks.artifact_input"),
        ("calibration/synthetic.py", "import engines.hardware", "calibration.synthetic", "engines.hardware"),
        ("engines/hardware.py", "import calibration.synthetic", "engines.hardware", "calibration.synthetic"),
    ],
)
def test_an_upward_or_sideways_import_breaks_the_layers_contract(tree_copy, module, line, importer, imported):
    path = tree_copy / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{line}  # noqa\n")
        proc = lint_imports(tree_copy)
    finally:
        path.write_text(original)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{LAYERS['name']} BROKEN" in proc.stdout
    assert f"{importer} -> {imported}" in proc.stdout


def test_the_pipelines_root_holds_its_spine_and_at_most_twenty_modules():
    """Trainers, exporters, source readers, model transforms and the docs tables live in subpackages
    that say what they are; the root keeps the run's spine (plan, pipeline, context, gate, ...)."""
    root = [Path(f).name for f in tracked("optimize") if re.fullmatch(r"optimize/\w+\.py", f)]
    assert len(root) <= 20, sorted(root)
    assert {"__init__.py", "__main__.py", "plan.py", "pipeline.py", "context.py", "gate.py", "registry.py"} <= set(root)
