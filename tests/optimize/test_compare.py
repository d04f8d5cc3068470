"""`python -m optimize.reports.compare` on manifests that pass the artifact checker but hold fields of the wrong
type (edited and digested again: the checker does not look at the recipe, the metrics or the
environment), and on artifacts whose paths inside their DIRs are the same."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

from engines.artifact import MANIFEST, read_manifest, seal
from optimize.reports.compare import build_table, labels_of, render_csv, render_markdown, render_plot
from tests.support.cli import ROOT, one_error_line


def compare(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimize.reports.compare", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _set(tree: dict, dotted: str, value) -> dict:
    """A deep copy of the manifest with one field replaced (parents made dicts where needed)."""
    tree = json.loads(json.dumps(tree))
    node = tree
    *parents, last = dotted.split(".")
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value
    return tree


# Each is one field a hostile manifest sets to a type compare used to trust (every one a traceback).
MISTYPED = {
    "recipe": "minilm",
    "recipe.name": ["a", "list"],
    "recipe.resolved": 5,
    "metrics": [1, 2],
    "metrics.candidate": "fast",
    "metrics.candidate.speedup": {"abc": 2.0, "-3": 1.0, "1": "quick", "2": [1]},
    "metrics.candidate.fidelity": {"cosine_min": {"x": 1}},
    "environment": "a laptop",
    "environment.cpu": "x86",
    "environment.cpu.features": [1, {"a": 2}, None],
    "environment.cpu.cores": {"n": 2},
    "environment.cpu.model": "$\\frac{1}{$ mathtext",  # not TeX for the plot's titles
    "engine": ["onnx"],
    "verdict": {"passed": True},
}


def test_mistyped_manifest_fields_are_shown_as_missing(minilm_artifact):
    manifest = read_manifest(minilm_artifact)
    for dotted, value in MISTYPED.items():
        hostile = _set(manifest, dotted, value)
        table = build_table(["hostile", "real"], [hostile, manifest])
        markdown = render_markdown(table)
        assert markdown.count("\n| hostile |") + markdown.count("\n| real |") == 2, dotted
        assert render_csv(table).count("\n") == 3 and render_plot(table)[:4] == b"\x89PNG", dotted
        hostile_row = table["rows"][0]
        assert all(v is None or isinstance(v, (int, float, str)) for v in hostile_row.values()), dotted
    key = "metrics.candidate.speedup"
    speedups = build_table(["h"], [_set(manifest, key, MISTYPED[key])])
    assert speedups["batches"] == [1, 2] and speedups["rows"][0]["speedup_b1"] == "quick"
    assert speedups["rows"][0]["speedup_b2"] is None  # a list where a figure belongs: missing


def test_compare_reads_a_hostile_manifest_through_the_command_line(minilm_artifact, tmp_path):
    hostile = Path(shutil.copytree(minilm_artifact, tmp_path / "hostile"))
    manifest = read_manifest(hostile)
    for dotted in ("recipe", "metrics.candidate.speedup", "environment.cpu.features", "verdict"):
        manifest = _set(manifest, dotted, MISTYPED[dotted])
    (hostile / MANIFEST).write_text(json.dumps(seal(manifest)))
    proc = compare(hostile, minilm_artifact, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["artifact"] for r in rows] == ["hostile", "artifact"]
    assert rows[0]["verdict"] == "unknown" and rows[1]["verdict"] == "passed"


def test_labels_are_the_shortest_path_suffix_that_tells_artifacts_apart(tmp_path):
    runs = [tmp_path / "run1" / "artifact", tmp_path / "run2" / "artifact"]
    assert labels_of(runs, [p.parent for p in runs]) == ["run1/artifact", "run2/artifact"]
    sweep = [tmp_path / "sweep" / str(n) / "artifact" for n in range(3)]
    assert labels_of(sweep, [tmp_path / "sweep"]) == ["0/artifact", "1/artifact", "2/artifact"]
    deep = [tmp_path / "a" / "x" / "artifact", tmp_path / "b" / "x" / "artifact", tmp_path / "c" / "y"]
    assert labels_of(deep, deep) == ["a/x/artifact", "b/x/artifact", "y"]


def test_two_dirs_each_holding_an_artifact_get_two_names(minilm_artifact, tmp_path):
    for run in ("run1", "run2"):
        shutil.copytree(minilm_artifact, tmp_path / run / "artifact")
    out = tmp_path / "report"
    out.mkdir()
    proc = compare(tmp_path / "run1", tmp_path / "run2", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out / "compare.csv") as f:
        assert [r["artifact"] for r in csv.DictReader(f)] == ["run1/artifact", "run2/artifact"]
    assert "| run1/artifact |" in (out / "compare.md").read_text()
    one_error_line(compare(tmp_path / "run1", "--out", tmp_path / "run1" / "artifact"), "inside the artifact")


def test_out_inside_an_artifact_not_compared_is_refused(minilm_artifact, tmp_path):
    shutil.copytree(minilm_artifact, tmp_path / "run1" / "artifact")
    other = tmp_path / "other"
    shutil.copytree(minilm_artifact, other)
    (other / "tokenizer" / "sub").mkdir(parents=True, exist_ok=True)
    for out in (other, other / "tokenizer" / "sub"):
        one_error_line(compare(tmp_path / "run1", "--out", out), "inside the artifact", str(other))
    assert not list(other.rglob("compare.*"))
