"""The import check sees the whole house: the graph import-linter builds holds every module of the four
code packages (a folder without `__init__.py` is a namespace package, which the graph skips, so it
could hide a cycle), and the contracts it checks on that graph break when an import points the wrong
way."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from optimize import registry

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
LINTER = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
ROOTS: tuple[str, ...] = tuple(LINTER["root_packages"])

# Files shipped inside artifacts and bundles, outside the import graph on purpose, each with why.
SHIPPED_ASSETS = {
    "optimize/assets/bundle/run.py": "the bundle's entry script, copied into every bundle and run there as "
    "`python run.py`, where the project need not be installed",
    "optimize/assets/bundle/runtimes.py": "copied into every bundle and loaded by run.py by its path once the "
    "bundle's files match its manifest",
}


def module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph_modules(*roots: str) -> set[str]:
    """The modules of `roots` in the graph, built as lint-imports builds it ([tool.importlinter])."""
    graph = grimp.build_graph(
        *roots, include_external_packages=LINTER.get("include_external_packages", False), cache_dir=None
    )
    return {m for m in graph.modules if m.split(".")[0] in roots}


def unseen_modules(files: list[str], in_graph: set[str]) -> set[str]:
    """The modules of these .py files that the graph does not hold."""
    return {module_name(f) for f in files if f.endswith(".py")} - in_graph


def tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--", *ROOTS], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [f for f in listed if f.endswith(".py")]


def test_the_import_graph_holds_every_tracked_module_but_the_shipped_assets():
    files = tracked_files()
    assert set(SHIPPED_ASSETS) <= set(files), "an allow-listed asset is gone: drop it from SHIPPED_ASSETS"
    code = [f for f in files if f not in SHIPPED_ASSETS]
    in_graph = graph_modules(*ROOTS)
    assert unseen_modules(code, in_graph) == set(), "a folder of code without __init__.py is outside the check"
    assert in_graph == {module_name(f) for f in code}, "a module the graph holds is not tracked (git add it)"
    assert not {module_name(f) for f in SHIPPED_ASSETS} & in_graph


def test_a_folder_without_init_is_reported_missing_from_the_graph(tmp_path, monkeypatch):
    package = tmp_path / "layout_probe"
    (package / "methods").mkdir(parents=True)
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "gate.py").write_text("from layout_probe.methods import race\n")
    (package / "methods" / "race.py").write_text("import layout_probe.gate\n")  # a cycle the graph cannot see
    files = [p.relative_to(tmp_path).as_posix() for p in package.rglob("*.py")]
    monkeypatch.syspath_prepend(str(tmp_path))

    assert unseen_modules(files, graph_modules("layout_probe")) == {"layout_probe.methods.race"}
    (package / "methods" / "__init__.py").write_text('"""Methods."""\n')
    files.append("layout_probe/methods/__init__.py")
    assert unseen_modules(files, graph_modules("layout_probe")) == set()


def test_every_package_says_what_it_holds():
    """The layout in docs/design.md is made of these docstrings (optimize/docs/tables.py)."""
    packages = [f for f in tracked_files() if f.endswith("__init__.py")]
    assert [p for p in packages if not ast.get_docstring(ast.parse((REPO / p).read_text()))] == []


def test_the_method_packages_contract_covers_every_package_that_registers_methods():
    contract = next(c for c in LINTER["contracts"] if c["name"].startswith("method packages never import"))
    assert set(contract["source_modules"]) == set(registry.METHOD_PACKAGES)
    assert set(contract["forbidden_modules"]) == {"optimize.pipeline", "optimize.__main__", "optimize.reports"}


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    """The four packages as tracked, and pyproject.toml, in a folder of their own."""
    root = tmp_path_factory.mktemp("tree")
    for path in tracked_files():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / path, root / path)
    shutil.copyfile(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint_imports(root: Path) -> dict[str, str]:
    """Each contract's verdict (KEPT or BROKEN) as lint-imports reports it on the tree at `root`."""
    script = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(script) if script.exists() else "lint-imports", "--no-cache", "--no-logo"],
        cwd=root,
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    names = {c["name"] for c in LINTER["contracts"]}
    verdicts = {}
    for line in proc.stdout.splitlines():
        name, _, verdict = line.rpartition(" ")
        if name in names and verdict in ("KEPT", "BROKEN"):
            verdicts[name] = verdict
    assert set(verdicts) == names, proc.stdout + proc.stderr
    return verdicts


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # optimize.compile.race.choice imports optimize.gate: an import back is a cycle
        ("optimize/gate.py", "from optimize.compile.race import choice", "no import cycles among"),
        ("optimize/prune/common.py", "from optimize.reports import console", "method packages never import"),
        ("engines/text.py", "import optimize.errors", "engines and calibration never import optimize"),
    ],
)
def test_an_import_that_points_the_wrong_way_breaks_a_contract(tree_copy, module, line, broken):
    path = tree_copy / module
    original = path.read_text()
    assert set(lint_imports(tree_copy).values()) == {"KEPT"}  # the copy is the tree as it is
    try:
        path.write_text(original + f"\n{line}  # noqa\n")
        verdicts = lint_imports(tree_copy)
    finally:
        path.write_text(original)
    assert [name for name, verdict in verdicts.items() if verdict == "BROKEN" and name.startswith(broken)]
