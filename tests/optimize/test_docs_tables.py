"""The tables in docs/ made from the code: current ones pass the check `make lint` runs, a stale, missing
or unknown one fails it by name, and a rewrite makes a stale one current again."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from optimize import registry
from optimize.compile.race.candidates import CANDIDATES
from optimize.docs import tables as docs_tables


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "docs"
    shutil.copytree(docs_tables.DOCS, folder)
    return folder


def test_the_docs_tables_are_current_as_make_lint_checks_them():
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.docs.tables", "--check"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == proc.stderr == ""


def test_every_table_is_in_docs_once_with_every_method_threshold_and_candidate():
    from optimize.gate import gate_keys

    text = "".join(p.read_text() for p in docs_tables.documents())
    for name in docs_tables.TABLES:
        assert text.count(f"<!-- generated:{name} ") == 1 and text.count(f"<!-- end generated:{name} -->") == 1
    assert all(f"| `{m.name}` |" in text for m in registry.all_methods())
    assert all(f"| `gate.{key}` |" in text for key in gate_keys())
    assert all(f"| `{name}` |" in text for name in CANDIDATES)


def test_a_stale_table_fails_the_check_by_name_and_a_rewrite_makes_it_current(docs, capsys):
    gate = docs / "gate.md"
    gate.write_text(gate.read_text().replace("| `gate.min_cosine` |", "| `gate.min_cosine_renamed` |"))
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 1
    assert capsys.readouterr().err.strip() == f"{gate}: the 'gate' table is stale; run python -m optimize.docs.tables"
    assert "min_cosine_renamed" in gate.read_text()  # --check writes nothing

    assert docs_tables.main(["--docs", str(docs)]) == 0
    assert capsys.readouterr().out.strip() == f"rewrote {gate}"
    assert "min_cosine_renamed" not in gate.read_text()
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 0
    assert all((docs / p.name).read_text() == p.read_text() for p in docs_tables.DOCS.glob("*.md"))


def test_a_method_added_to_the_code_makes_the_methods_table_stale(docs, monkeypatch, capsys):
    @dataclass
    class DocConfig:
        bits: int = 8

    def doc_method(model, cfg, ctx):
        """Adds nothing: a method the docs have not heard of."""
        return model

    method = registry.Method("quantize", "tmp_doc_method", DocConfig, doc_method, summary="Adds nothing.")
    registry.all_methods()  # every real method is registered before this one
    monkeypatch.setitem(registry._METHODS, ("quantize", "tmp_doc_method"), method)
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 1
    assert "the 'methods' table is stale" in capsys.readouterr().err
    assert docs_tables.main(["--docs", str(docs)]) == 0
    row = "| quantize | `tmp_doc_method` | ONNX graph |  | every task | Adds nothing. |"
    assert row in (docs / "recipes.md").read_text()


def test_a_missing_or_unknown_table_is_named(docs, capsys):
    race = docs / "race.md"
    markers = ("<!-- generated:race (python -m optimize.docs.tables) -->\n", "<!-- end generated:race -->\n")
    race.write_text(race.read_text().replace(markers[0], "").replace(markers[1], ""))
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 1
    err = capsys.readouterr().err
    assert f"{docs}: no generated 'race' table (its markers are missing)" in err
    # A rewrite cannot fix a table it cannot find: it says so and fails too.
    assert docs_tables.main(["--docs", str(docs)]) == 1
    assert "no generated 'race' table" in capsys.readouterr().err

    (docs / "extra.md").write_text("<!-- generated:nonsense (x) -->\n| a |\n<!-- end generated:nonsense -->\n")
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 1
    assert f"{docs / 'extra.md'}: unknown generated table 'nonsense' (known: {', '.join(docs_tables.TABLES)})" in (
        capsys.readouterr().err
    )


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A copy of the code packages and pyproject.toml that the layout and contracts tables are read from."""
    root = tmp_path / "tree"
    for name in docs_tables.PACKAGES:
        shutil.copytree(docs_tables.ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(docs_tables.ROOT / "pyproject.toml", root / "pyproject.toml")
    monkeypatch.setattr(docs_tables, "ROOT", root)
    return root


def test_a_module_moved_into_a_new_package_makes_the_layout_stale(docs, tree, capsys):
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 0
    runtime = tree / "engines" / "example_runtime"
    runtime.mkdir()
    (runtime / "__init__.py").write_text('"""An example runtime: its runner. More detail here."""\n')
    (tree / "engines" / "onnxruntime" / "runner.py").rename(runtime / "runner.py")
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 1
    assert (
        capsys.readouterr().err.strip()
        == f"{docs / 'design.md'}: the 'layout' table is stale; run {docs_tables.COMMAND}"
    )

    assert docs_tables.main(["--docs", str(docs)]) == 0
    layout = (docs / "design.md").read_text()
    assert (
        "| **`engines/example_runtime/`** | An example runtime: its runner. |\n| `runner` | ONNX Runtime Runner. |"
        in layout
    )
    onnxruntime = layout.split("| **`engines/onnxruntime/`** |")[1].split("| **`")[0]
    assert "| `runner` |" not in onnxruntime and "| `export` |" in onnxruntime


def test_a_renamed_contract_makes_the_contracts_list_stale(docs, tree, capsys):
    pyproject = tree / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('name = "engines never import serve"', 'name = "renamed"'))
    assert docs_tables.main(["--check", "--docs", str(docs)]) == 1
    assert "the 'contracts' table is stale" in capsys.readouterr().err
    assert docs_tables.main(["--docs", str(docs)]) == 0
    assert "- renamed (`forbidden`)\n" in (docs / "design.md").read_text()


def test_hostile_md_files_are_named_in_one_line_and_never_followed(docs, tmp_path, capsys):
    import os
    import threading

    (docs / "latin1.md").write_bytes(b"caf\xe9\n")
    os.mkfifo(docs / "pipe.md")
    outside = tmp_path / "outside.md"
    outside.write_text((docs / "gate.md").read_text().replace("| `gate.min_cosine` |", "| `stale` |"))
    (docs / "linked.md").symlink_to(outside)
    before = outside.read_text()
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(docs_tables.main(["--docs", str(docs)])), daemon=True)
    runner.start()
    runner.join(120)
    assert result == [1], "hung on the FIFO" if not result else result  # a FIFO read would block forever
    err = capsys.readouterr().err.strip().splitlines()
    assert any("latin1.md: not UTF-8 text" in line for line in err)
    assert any("pipe.md: not a regular file" in line for line in err)
    assert any("linked.md: a symbolic link" in line for line in err)
    assert all("Traceback" not in line for line in err)
    assert outside.read_text() == before  # the link's target, outside --docs, is untouched
