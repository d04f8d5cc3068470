"""CI reports: report.md and junit.xml in the artifact, report.junit, GitHub's step summary and outputs,
and the GitHub Actions example, on a real run whose gate fails (tests/conftest.py failed_gate_run)."""

from __future__ import annotations

import copy
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from engines.artifact import read_manifest, verify
from optimize.reports import ci
from tests.support.cli import ROOT, one_error_line, refusal_in_process

EXAMPLE = ROOT / "examples" / "github-actions" / "optimize.yml"


def _suite(xml_bytes: bytes) -> ET.Element:
    """The JUnit structure GitHub Actions reporters, GitLab and Jenkins read: <testsuites> holding
    <testsuite> elements with tests/failures/errors counts, <testcase name classname> children, and a
    <failure message type> in each failed case."""
    root = ET.fromstring(xml_bytes)
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = suite.findall("testcase")
    children = [child.tag for child in suite]  # the Ant schema's order: properties, testcases, streams
    assert children == ["properties", *["testcase"] * len(cases), "system-out", "system-err"]
    for element in (root, suite):
        assert int(element.get("tests")) == len(cases)
        assert int(element.get("failures")) == sum(c.find("failure") is not None for c in cases)
        assert element.get("errors") == "0"
        float(element.get("time"))
    for case in cases:
        assert case.get("name") and case.get("classname")
        failure = case.find("failure")
        if failure is not None:
            assert failure.get("message") and failure.get("type")
    return suite


def test_a_failing_gate_is_a_junit_failure_in_the_artifact_and_where_ci_looks(failed_gate_run):
    manifest = read_manifest(failed_gate_run.artifact)
    inside = (failed_gate_run.artifact / "junit.xml").read_bytes()
    assert failed_gate_run.junit.read_bytes() == inside  # report.junit is the same file
    suite = _suite(inside)
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert set(cases) == {c["name"] for c in manifest["gate"]["checks"]}
    failure = cases["min_cosine"].find("failure")
    value = next(c["value"] for c in manifest["gate"]["checks"] if c["name"] == "min_cosine")
    assert failure.get("type") == "GateCheckFailed"
    assert failure.get("message") == f"fidelity cosine (min) = {value:.4g}, required >= 1.01"
    assert all(cases[name].find("failure") is None for name in ("min_mean_cosine", "min_topk_agreement"))
    assert suite.get("failures") == "1" and suite.get("tests") == "3"
    properties = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert properties["manifest_id"] == manifest["id"] and properties["verdict"] == "failed"


def test_the_reports_are_part_of_the_artifact_and_verified_with_it(failed_gate_run):
    manifest = read_manifest(failed_gate_run.artifact)
    assert {"report.md", "junit.xml"} <= {f["path"] for f in manifest["files"]}
    assert verify(failed_gate_run.artifact) == []
    text = (failed_gate_run.artifact / "report.md").read_text()
    for heading in ("## Baseline vs candidate", "## Gate", "## Stages", "## Data", "## Environment", "## Plots"):
        assert heading in text
    assert "| min_cosine | fidelity cosine (min) |" in text and "| >= 1.01 | FAIL |" in text
    assert "**quantize**: `ort_int8_dynamic`" in text and "fp32_nodes: []" in text  # nothing kept back
    assert manifest["calibration"]["sha256"] in text and manifest["evaluation"]["sha256"] in text
    assert manifest["id"] in text and manifest["environment"]["cpu"]["model"] in text


def test_the_step_summary_gets_the_tables_and_the_outputs_the_verdict(failed_gate_run):
    manifest = read_manifest(failed_gate_run.artifact)
    summary = failed_gate_run.summary.read_text()
    assert summary.startswith("# earlier step\n")  # appended, not replaced
    assert "**gate FAILED** (failed: min_cosine)" in summary
    assert "| check | metric | value | threshold | result |" in summary
    assert re.search(r"\| size on disk MB \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", summary)
    outputs = dict(line.split("=", 1) for line in failed_gate_run.outputs.read_text().splitlines())
    assert outputs["verdict"] == "failed"
    assert outputs["artifact"] == str(failed_gate_run.artifact)
    assert outputs["manifest_id"] == manifest["id"]
    sizes = manifest["metrics"]["candidate"]["size_mb"] / manifest["metrics"]["baseline"]["size_mb"]
    assert float(outputs["size_ratio"]) == round(sizes, 3)
    assert "speedup" not in outputs  # latency was not measured in this run: no made-up figure


def test_an_untrusted_timing_and_an_unmeasured_metric_have_their_own_messages(failed_gate_run):
    manifest = copy.deepcopy(read_manifest(failed_gate_run.artifact))
    manifest["gate"]["checks"] += [
        {
            "name": "min_speedup",
            "metric": "speedup at p50, batch 1",
            "value": 2.4,
            "comparison": ">=",
            "threshold": 1.5,
            "passed": False,
            "note": "untrusted: other processes used 60% of the CPUs while timing",
        },
        {
            "name": "max_peak_memory_mb",
            "metric": "peak memory (MB)",
            "value": None,
            "comparison": "<=",
            "threshold": 500,
            "passed": False,
            "note": "not measured",
        },
    ]
    suite = _suite(ci.junit_xml(manifest, failed_gate_run.artifact))
    failures = {c.get("name"): c.find("failure") for c in suite.findall("testcase") if c.find("failure") is not None}
    assert failures["min_speedup"].get("type") == "UntrustedTiming"
    assert failures["min_speedup"].get("message") == (
        "speedup at p50, batch 1 = 2.4 not trusted (other processes used 60% of the CPUs while timing); required >= 1.5"
    )
    assert failures["max_peak_memory_mb"].get("type") == "NotMeasured"
    assert suite.get("failures") == "3"


def test_report_junit_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    proc = refusal_in_process(f"report.junit={tmp_path / 'taken' / 'junit.xml'}", f"output_dir={tmp_path / 'out'}")
    one_error_line(proc, "report.junit=", "not a writable directory")
    proc = refusal_in_process(f"report.junit={tmp_path}", f"output_dir={tmp_path / 'out'}")
    one_error_line(proc, "is a directory")
    assert not (tmp_path / "out").exists()


def _workflow_steps() -> list[dict]:
    workflow = yaml.safe_load(EXAMPLE.read_text())
    assert (workflow.get("on") or workflow.get(True)) is not None  # YAML 1.1 reads `on` as true
    (job,) = workflow["jobs"].values()
    return job["steps"]


def test_the_github_actions_example_runs_a_recipe_uploads_the_artifact_and_fails_on_the_gate(tmp_path):
    from optimize.__main__ import compose_recipe
    from optimize.config import register_schema

    steps = _workflow_steps()
    run_steps = [s for s in steps if "python -m optimize" in s.get("run", "")]
    assert len(run_steps) == 1
    optimize_step = run_steps[0]
    # The gate fails the job: the step's exit code is not swallowed.
    assert "continue-on-error" not in optimize_step and "|| true" not in optimize_step["run"]
    # Its command composes into a valid recipe (every key exists), with the expressions filled in.
    words = shlex.split(re.sub(r"\$\{\{\s*runner\.temp\s*\}\}", str(tmp_path), optimize_step["run"]))
    overrides = words[words.index("optimize") + 1 :]
    register_schema()
    cfg = compose_recipe(overrides)
    # Every later step runs after a failed gate too, and uploads what the run wrote.
    later = steps[steps.index(optimize_step) + 1 :]
    assert later and all(s.get("if") == "always()" for s in later)
    uploads = [s for s in later if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    artifact_path = re.sub(r"\$\{\{\s*runner\.temp\s*\}\}", str(tmp_path), uploads[0]["with"]["path"])
    assert Path(artifact_path) == Path(cfg.output_dir)
    junit = [s for s in later if "report_paths" in (s.get("with") or {})]
    assert junit and junit[0]["with"]["report_paths"] == cfg.report.junit
    outputs = set(re.findall(r"steps\.optimize\.outputs\.(\w+)", yaml.safe_dump(later)))
    assert outputs <= {"verdict", "artifact", "manifest_id", "speedup", "decode_speedup", "size_ratio", "cosine_min"}
    assert optimize_step["id"] == "optimize"
    assert "examples/github-actions/optimize.yml" in (ROOT / "docs" / "ci.md").read_text()
