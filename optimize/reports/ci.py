"""CI reports of a run, written into the artifact and, where asked, where CI reads them.

- `report.md`: baseline vs candidate, every gate check, the stages, the data, the environment, the plots;
- `junit.xml`: one test case per gate check (one per workload point for a check at `all` points:
  `min_speedup[batch=32]`), in the JUnit XML that GitHub Actions, GitLab and Jenkins read
  (a failed check is a `<failure>` whose message gives value, comparison and threshold);
- `report.junit=PATH` copies junit.xml there; `GITHUB_STEP_SUMMARY` gets the summary tables appended and
  `GITHUB_OUTPUT` the verdict, the artifact path and the headline ratios, when those variables are set.

The tables are the console report's rows (optimize/reports/console.py), rendered as Markdown here.
"""

from __future__ import annotations

import json
import os
import socket
import xml.etree.ElementTree as ET
from pathlib import Path

from optimize.errors import RecipeError
from optimize.reports import console

REPORT_MD, JUNIT_XML = "report.md", "junit.xml"
PLOT_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg")
STEP_SUMMARY_ENV, STEP_OUTPUT_ENV = "GITHUB_STEP_SUMMARY", "GITHUB_OUTPUT"


# --- Markdown ---------------------------------------------------------------------------------------


def markdown_table(rows: list[list[str]]) -> str:
    """Rows (the first is the header) as a GitHub-flavoured Markdown table."""

    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(rows[0]), "|" + "---|" * len(rows[0]), *(line(r) for r in rows[1:])])


def verdict_line(manifest: dict) -> str:
    checks = manifest["gate"]["checks"]
    failed = [c["name"] for c in checks if not c["passed"]]
    head = f"**gate {'PASSED' if manifest['gate']['passed'] else 'FAILED'}**"
    detail = f"failed: {', '.join(failed)}" if failed else f"{len(checks)} checks passed"
    return f"{head} ({detail}) - recipe `{manifest['recipe']['name']}`, model `{manifest['model']['source']}`"


def summary_markdown(manifest: dict, path) -> str:
    """The verdict and both tables: what a CI step summary shows."""
    return "\n\n".join(
        [
            f"## optimize: {manifest['recipe']['name']}",
            verdict_line(manifest),
            markdown_table(console.metrics_rows(manifest["metrics"])),
            markdown_table(console.check_rows(manifest["gate"])),
            f"artifact: `{path}` (manifest id `{manifest['id']}`)",
        ]
    )


def _short(value, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stage_lines(stages: dict) -> list[str]:
    """Each stage's record: its method, then every fact it recorded (what was quantized, kept in
    float, pruned), one bullet each, long values shortened (the manifest has them whole)."""
    if not stages:
        return ["no stage records"]
    lines = []
    for stage, record in stages.items():
        lines.append(f"- **{stage}**: `{record.get('method', '-')}`")
        for key, value in record.items():
            if key != "method" and value is not None:  # an empty list says something: nothing kept back
                lines.append(f"  - {key}: {_short(value)}")
    return lines


def _data_lines(manifest: dict) -> list[str]:
    lines = []
    for what in ("calibration", "evaluation"):
        data = manifest.get(what)
        if not data:
            lines.append(f"- {what}: none")
            continue
        facts = ", ".join(f"{k} {v}" for k, v in data.items() if k not in ("source", "sha256") and v is not None)
        lines.append(f"- {what}: `{data.get('source')}` ({facts}; sha256 `{data.get('sha256', '-')}`)")
    return lines


def plots(manifest: dict) -> list[str]:
    """The artifact's images, relative paths."""
    return [f["path"] for f in manifest.get("files", []) if f["path"].lower().endswith(PLOT_SUFFIXES)]


def render_markdown(manifest: dict, path, plot_paths: list[str]) -> str:
    env = manifest.get("environment") or {}
    packages = ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items())
    gpus = ", ".join(map(str, env.get("gpus") or [])) or "none"
    parts = [
        f"# {manifest['recipe']['name']}: {'PASSED' if manifest['gate']['passed'] else 'FAILED'}",
        verdict_line(manifest),
        f"- artifact: `{path}`\n- manifest id: `{manifest['id']}`\n- parent id: `{manifest.get('parent_id')}`\n"
        f"- engine: {manifest['engine'].get('format')} {manifest['engine'].get('precision')}\n"
        f"- created: {manifest.get('created')}",
        "## Baseline vs candidate",
        markdown_table(console.metrics_rows(manifest["metrics"])),
        *console.baseline_lines(manifest["metrics"]),
        "## Gate",
        markdown_table(console.check_rows(manifest["gate"])),
        "## Stages",
        "\n".join(_stage_lines(manifest.get("stages") or {})),
        "## Data",
        "\n".join(_data_lines(manifest)),
        "## Environment",
        "\n".join(
            [
                *(f"- {line}" for line in console.environment_lines(manifest)),
                f"- Python {env.get('python')}, {env.get('platform')}; GPUs: {gpus}",
                f"- packages: {packages}",
            ]
        ),
        "## Plots",
        "\n".join(f"![{p}]({p})" for p in plot_paths) or "no plots in this artifact",
    ]
    return "\n\n".join(parts) + "\n"


# --- JUnit XML --------------------------------------------------------------------------------------


def _failure(check: dict) -> tuple[str, str]:
    """(type, message) of a failed check: an untrusted timing and an unmeasured metric say so, not a value."""
    note, value = check.get("note") or "", check["value"]
    if value is None:
        return "NotMeasured", f"{check['metric']} was not measured; required {check['comparison']} {check['threshold']}"
    if note.startswith("untrusted"):
        return "UntrustedTiming", (
            f"{check['metric']} = {value:.4g} not trusted ({note.removeprefix('untrusted: ')}); "
            f"required {check['comparison']} {check['threshold']}"
        )
    return "GateCheckFailed", f"{check['metric']} = {value:.4g}, required {check['comparison']} {check['threshold']}"


def junit_xml(manifest: dict, path) -> bytes:
    """One testsuite (the run's gate), one testcase per check; failures carry value and threshold."""
    checks = manifest["gate"]["checks"]
    failures = sum(not c["passed"] for c in checks)
    counts = {"tests": str(len(checks)), "failures": str(failures), "errors": "0", "skipped": "0"}
    duration = str(manifest.get("duration_s") or 0)
    suites = ET.Element("testsuites", {"name": "optimize", "time": duration, **counts})
    suite = ET.SubElement(
        suites,
        "testsuite",
        {
            "name": f"gate.{manifest['recipe']['name']}",
            "timestamp": str(manifest.get("created", ""))[:19],
            "hostname": socket.gethostname(),
            "time": duration,
            **counts,
        },
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("artifact", str(path)),
        ("manifest_id", manifest["id"]),
        ("verdict", manifest["verdict"]),
        ("model", manifest["model"]["source"]),
    ):
        ET.SubElement(props, "property", name=name, value=value)
    for check in checks:
        case = ET.SubElement(
            suite, "testcase", name=check["name"], classname=f"optimize.gate.{manifest['recipe']['name']}", time="0"
        )
        if not check["passed"]:
            kind, message = _failure(check)
            failure = ET.SubElement(case, "failure", message=message, type=kind)
            failure.text = json.dumps(check)
        else:
            ET.SubElement(case, "system-out").text = f"{check['metric']} = {check['value']:.4g}"
    # The Ant schema Jenkins validates against wants both streams on the suite, even when empty.
    ET.SubElement(suite, "system-out").text = f"artifact: {path}"
    ET.SubElement(suite, "system-err").text = ""
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


# --- writing ----------------------------------------------------------------------------------------


def write_into(stage: Path, manifest: dict, final: Path) -> None:
    """report.md and junit.xml in the artifact being built (before its manifest lists the files)."""
    images = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.suffix.lower() in PLOT_SUFFIXES)
    (stage / REPORT_MD).write_text(render_markdown(manifest, final, images))
    (stage / JUNIT_XML).write_bytes(junit_xml(manifest, final))


def check_destination(junit: str | None) -> None:
    """report.junit must be a file path whose folder exists or can be made, and is writable."""
    if not junit:
        return
    target = Path(junit).expanduser()
    if target.is_dir():
        raise RecipeError(f"report.junit={junit} is a directory; give a file path such as reports/junit.xml")
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise RecipeError(f"report.junit={junit}: {ancestor} is not a writable directory")


def headline(manifest: dict) -> dict[str, str]:
    """The figures a CI step passes on: speedups and the size ratio (only those that were measured)."""
    metrics, thresholds = manifest["metrics"], (manifest["recipe"]["resolved"].get("gate") or {})
    cand, base = metrics["candidate"], metrics["baseline"]
    out = {}
    selector = str(thresholds.get("speedup_batch_size") or 1)
    speedups = cand.get("speedup") or {}
    if selector.lower() == "all" and speedups:  # every point is checked: pass on the worst one
        out["speedup"] = f"{min(speedups.values()):.3f}"
    elif speedups.get(selector) is not None:
        out["speedup"] = f"{speedups[selector]:.3f}"
    if cand.get("decode_speedup") is not None:
        out["decode_speedup"] = f"{cand['decode_speedup']:.3f}"
    if cand.get("size_mb") and base.get("size_mb"):
        out["size_ratio"] = f"{cand['size_mb'] / base['size_mb']:.3f}"
    if (cand.get("fidelity") or {}).get("cosine_min") is not None:
        out["cosine_min"] = f"{cand['fidelity']['cosine_min']:.4f}"
    return out


def _append(path: str, text: str, what: str) -> None:
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise RecipeError(f"{what}={path}: cannot write ({exc.strerror})") from None


def step_outputs(manifest: dict, path) -> str:
    """GITHUB_OUTPUT lines (`name=value`, or the delimited form for a value with a newline)."""
    values = {"verdict": manifest["verdict"], "artifact": str(path), "manifest_id": manifest["id"]}
    values.update(headline(manifest))
    lines = []
    for name, value in values.items():
        if "\n" in value:
            delimiter = f"EOF_{manifest['id'][:16]}"
            lines.append(f"{name}<<{delimiter}\n{value}\n{delimiter}")
        else:
            lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n"


def export(manifest: dict, path: Path, junit: str | None) -> list[str]:
    """After a run: junit.xml copied to `junit`, and the GitHub step summary and outputs when their
    variables are set. Returns what was written, for the console."""
    written = []
    if junit:
        target = Path(junit).expanduser()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((Path(path) / JUNIT_XML).read_bytes())
        except OSError as exc:
            raise RecipeError(f"report.junit={junit}: cannot write ({exc.strerror})") from None
        written.append(f"junit: {target}")
    if os.environ.get(STEP_SUMMARY_ENV):
        _append(os.environ[STEP_SUMMARY_ENV], summary_markdown(manifest, path) + "\n\n", STEP_SUMMARY_ENV)
        written.append("step summary: written")
    if os.environ.get(STEP_OUTPUT_ENV):
        _append(os.environ[STEP_OUTPUT_ENV], step_outputs(manifest, path), STEP_OUTPUT_ENV)
        written.append("step outputs: verdict, artifact, manifest_id, " + ", ".join(headline(manifest)))
    return written
