"""`python -m optimize.reports.compare DIR... [--out FOLDER]`: the artifacts of a sweep (or any artifacts) in one table.

Each DIR is an artifact or a folder searched for artifacts (a multirun's sweep folder: its jobs'
`NUM/artifact`). Every manifest is checked with the one artifact checker (engines/artifact/) before
it is read: a changed file or an edited manifest refuses the whole comparison. One row per artifact:
the recipe settings that differ between them, verdict, engine and precision, headline fidelity,
speedups over the baseline, size, and the CPU the figures were measured on. Writes compare.csv,
compare.md and compare.png into FOLDER (default: the first DIR, when it is a sweep folder).

Latency ratios are only comparable on one kind of machine: when the rows come from different CPUs,
compare.md says so above the table and compare.png has one panel per CPU.

Exit 0 with the three files written; 2 when an input is refused (no such folder, no artifact found,
a tampered artifact, an unusable --out): one line `error: ...`, nothing written.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from engines.artifact import MANIFEST, ArtifactError, read_manifest, verify
from optimize import EXIT_BAD_INPUT
from optimize.errors import ArgumentParser, RecipeError

OUTPUTS = ("compare.csv", "compare.md", "compare.png")
# Candidate metrics worth a column, when any artifact has them: (column, path in metrics.candidate).
FIDELITY = (
    ("cosine_min", ("fidelity", "cosine_min")),
    ("cosine_mean", ("fidelity", "cosine_mean")),
    ("topk_agreement", ("fidelity", "topk_agreement")),
    ("top1_accuracy", ("top1_accuracy",)),
    ("accuracy_drop_points", ("accuracy_drop_points",)),
    ("perplexity_increase_pct", ("perplexity_increase_pct",)),
)
BATCH_KEY = re.compile(r"^[0-9]{1,6}$")  # a key of metrics.candidate.speedup: the batch size
# Settings that differ between the runs of any sweep and say nothing about the model.
IGNORED_SETTINGS = ("output_dir", "overwrite")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m optimize.reports.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="artifacts, or folders holding them (a sweep folder)")
    parser.add_argument("--out", type=Path, help="where to write compare.csv/.md/.png (default: the first DIR)")
    args = parser.parse_args(argv)
    try:
        artifacts = find_artifacts(args.dirs)
        out = output_folder(args.out, args.dirs, artifacts)
        manifests = [checked(path) for path in artifacts]
        table = build_table(labels_of(artifacts, args.dirs), manifests)
        write_outputs(out, table)
    except (RecipeError, ArtifactError) as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # writing the outputs: a full disk, a folder made read-only meanwhile
        print(f"error: cannot write the comparison: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(render_markdown(table))
    print(f"compare: {len(artifacts)} artifacts -> {', '.join(str(out / name) for name in OUTPUTS)}")
    return 0


# --- finding and checking artifacts ----------------------------------------------------------------


def find_artifacts(dirs: list[Path]) -> list[Path]:
    """Every artifact named or found under the folders, in a stable order; hidden folders (Hydra's
    .hydra, a run's .partial-* staging, submitit's logs) are not searched."""
    found: list[Path] = []
    for root in dirs:
        if not root.is_dir():
            raise RecipeError(f"{root} is not a directory")
        if os.path.lexists(root / MANIFEST):
            found.append(root)
            continue
        below = []
        for folder, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            if MANIFEST in files:
                below.append(Path(folder))
                subdirs[:] = []  # an artifact's own folders hold no other artifact
        if not below:
            raise RecipeError(f"{root}: no artifact ({MANIFEST}) in it or below it")
        found += sorted(below, key=_natural)
    seen: set[Path] = set()
    unique = []
    for path in found:
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique


def labels_of(artifacts: list[Path], dirs: list[Path]) -> list[str]:
    """Each artifact's name in the table: its path inside the folder it was found in (a sweep's
    `3/artifact`), or the folder's own name when it is the artifact. Names that two artifacts share
    (two runs' folders each holding `artifact`) take one more folder of their path at a time, until
    every name is its own: the shortest path suffix that tells them apart."""
    paths = [path.resolve() for path in artifacts]
    lengths = [_inside(path, dirs) for path in paths]
    while True:
        labels = [_suffix(path, n) for path, n in zip(paths, lengths)]
        shared = {label for label in labels if labels.count(label) > 1}
        if not shared:
            return labels
        # Distinct resolved paths: lengthening every shared name ends at the full paths at the latest.
        lengths = [n + 1 if label in shared else n for label, n in zip(labels, lengths)]


def _inside(path: Path, dirs: list[Path]) -> int:
    """How many parts of the path lie below the DIR it was found in (1: the DIR is the artifact)."""
    for root in dirs:
        if root.resolve() in path.parents:
            return len(path.relative_to(root.resolve()).parts)
    return 1


def _suffix(path: Path, parts: int) -> str:
    return path.as_posix() if parts >= len(path.parts) else Path(*path.parts[-parts:]).as_posix()


def _natural(path: Path) -> list:
    """Sweep job folders 2 before 10."""
    return [int(part) if part.isdigit() else part for part in path.parts]


def checked(root: Path) -> dict:
    """The manifest of an artifact whose every file matches it (the checker serve/ and verify use)."""
    try:
        problems = verify(root)
        manifest = read_manifest(root)
    except OSError as exc:
        raise RecipeError(f"{root}: {exc.strerror or exc}") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RecipeError(f"{root} does not match its manifest: {problems[0]}{more}; refused")
    return manifest


def output_folder(out: Path | None, dirs: list[Path], artifacts: list[Path]) -> Path:
    if out is None:
        if os.path.lexists(dirs[0] / MANIFEST):
            raise RecipeError(f"{dirs[0]} is an artifact, not a sweep folder: give --out FOLDER for the comparison")
        out = dirs[0]
    if not out.is_dir():
        raise RecipeError(f"--out {out} is not a directory")
    if not os.access(out, os.W_OK | os.X_OK):
        raise RecipeError(f"--out {out} is not writable")
    target = out.resolve()
    for artifact in artifacts:
        if target == artifact.resolve() or artifact.resolve() in target.parents:
            raise RecipeError(f"--out {out} is inside the artifact {artifact}; it would no longer match its manifest")
    # Any artifact, compared or not: files written into one make it fail verify, and serve refuses it.
    for folder in (target, *target.parents):
        if os.path.lexists(folder / MANIFEST):
            raise RecipeError(f"--out {out} is inside the artifact {folder}; it would no longer match its manifest")
    return out


# --- the table ---------------------------------------------------------------------------------------


def flatten(tree, prefix: str = "") -> dict[str, str]:
    """Dotted keys to JSON-encoded values, so lists and nulls compare and print as written."""
    if isinstance(tree, dict):
        items: dict[str, str] = {}
        for key, value in tree.items():
            items.update(flatten(value, f"{prefix}{key}."))
        return items
    return {prefix.rstrip("."): json.dumps(tree)}


def settings_of(manifest: dict) -> dict[str, str]:
    """The recipe's name and resolved settings, flattened; a field of the wrong type is left out
    (the artifact checker does not check the recipe block: an edited manifest, digested again)."""
    recipe = _dict(manifest.get("recipe"))
    return {"recipe": json.dumps(recipe.get("name")), **flatten(_dict(recipe.get("resolved")))}


def differing_settings(manifests: list[dict]) -> list[str]:
    """The recipe keys (the recipe's name included) whose values are not the same in every artifact."""
    settings = [settings_of(m) for m in manifests]
    keys = sorted(set().union(*settings))
    return [key for key in keys if key not in IGNORED_SETTINGS and len({s.get(key, "(unset)") for s in settings}) > 1]


def _dict(value) -> dict:
    """A manifest field read where a dict is expected: any other type counts as missing."""
    return value if isinstance(value, dict) else {}


def _dig(tree, *keys):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _scalar(value):
    """A cell from a manifest field: a number or a string as it is, anything else (a list, a dict,
    a boolean where a figure belongs) as missing."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    return value


def _batches(candidate: dict) -> set[int]:
    """The batch sizes of metrics.candidate.speedup: its keys that are batch sizes; others are ignored."""
    return {int(key) for key in _dict(candidate.get("speedup")) if BATCH_KEY.match(key)}


def cpu_of(manifest: dict) -> str:
    cpu = _dict(_dict(manifest.get("environment")).get("cpu"))
    features = cpu.get("features")
    listed = ",".join(map(str, features)) if isinstance(features, list) else ""
    model, cores = _scalar(cpu.get("model")), _scalar(cpu.get("cores"))
    return f"{model or 'unknown CPU'} ({'?' if cores is None else cores} cores; {listed or 'no listed features'})"


def build_table(labels: list[str], manifests: list[dict]) -> dict:
    """{"columns": [...], "rows": [{column: value}], "cpus": [...]}: values as numbers or strings."""
    settings = differing_settings(manifests)
    candidates = [_dict(_dict(m.get("metrics")).get("candidate")) for m in manifests]
    fidelity = [(name, path) for name, path in FIDELITY if any(_dig(c, *path) is not None for c in candidates)]
    batches = sorted(set().union(*map(_batches, candidates)))
    decode = any(c.get("decode_speedup") is not None for c in candidates)
    timed = any(_dig(c, "timing", "other_cpu_share") is not None for c in candidates)
    rows = []
    for label, manifest, cand in zip(labels, manifests, candidates):
        resolved = settings_of(manifest)
        engine = _dict(manifest.get("engine"))
        row: dict = {"artifact": label}
        row.update({key: _plain(resolved.get(key)) for key in settings})
        row["verdict"] = _scalar(manifest.get("verdict")) or "unknown"
        row["engine"] = _scalar(engine.get("format")) or _scalar(cand.get("engine"))
        row["precision"] = _scalar(engine.get("precision")) or _scalar(cand.get("precision"))
        row.update({name: _scalar(_dig(cand, *keys)) for name, keys in fidelity})
        row.update({f"speedup_b{b}": _scalar(_dig(cand, "speedup", str(b))) for b in batches})
        if decode:
            row["decode_speedup"] = _scalar(cand.get("decode_speedup"))
        if timed:  # above 25%: latency untrusted
            row["other_cpu_share"] = _scalar(_dig(cand, "timing", "other_cpu_share"))
        row["size_mb"] = _scalar(cand.get("size_mb"))
        row["cpu"] = cpu_of(manifest)
        rows.append(row)
    columns = list(rows[0])
    cpus = list(dict.fromkeys(row["cpu"] for row in rows))
    return {"columns": columns, "rows": rows, "cpus": cpus, "settings": settings, "batches": batches}


def _plain(encoded: str | None):
    """A setting's JSON value as a cell: numbers and strings as themselves, lists as written."""
    if encoded is None:
        return "(unset)"
    value = json.loads(encoded)
    return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else encoded


# --- writing -----------------------------------------------------------------------------------------


def _cell(column: str, value) -> str:
    if value is None:
        return "-"
    if not isinstance(value, float):
        return " ".join(str(value).splitlines())  # a table row is one line
    if "speedup" in column:
        return f"{value:.2f}x"
    if column == "other_cpu_share":
        return f"{value:.0%}"
    if column == "size_mb" or abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.4f}"


def render_markdown(table: dict) -> str:
    lines = []
    if len(table["cpus"]) > 1:
        lines += [
            f"**These artifacts were measured on {len(table['cpus'])} different CPUs** (column `cpu`): speedups "
            "compare only between rows of the same CPU; across CPUs they compare the machines as much as the models.",
            "",
        ]
    else:
        lines += [f"All artifacts were measured on one kind of CPU: {table['cpus'][0]}.", ""]
    columns = [c for c in table["columns"] if c != "cpu" or len(table["cpus"]) > 1]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in table["rows"]:
        lines.append("| " + " | ".join(_cell(c, row[c]).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines) + "\n"


def render_csv(table: dict) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=table["columns"], lineterminator="\n")
    writer.writeheader()
    for row in table["rows"]:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def render_plot(table: dict) -> bytes:
    """Headline fidelity against speedup (or size, when nothing was timed), one panel per CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = next((c for c in table["columns"] if c in dict(FIDELITY)), None)
    y_key = f"speedup_b{table['batches'][0]}" if table["batches"] else "size_mb"
    fig, axes = plt.subplots(1, len(table["cpus"]), figsize=(6 * len(table["cpus"]), 4.5), squeeze=False)
    for ax, cpu in zip(axes[0], table["cpus"]):
        points: dict[tuple, list[dict]] = {}  # runs that differ only in the gate land on one point
        for number, row in enumerate(table["rows"]):
            x, y = row.get(x_key) if x_key else number, row.get(y_key)
            if row["cpu"] == cpu and _finite(x) and _finite(y):
                points.setdefault((x, y), []).append(row)
        for (x, y), rows in points.items():
            passed = any(row["verdict"] == "passed" for row in rows)
            ax.scatter([x], [y], color="tab:green" if passed else "tab:red")
            label = ", ".join(row["artifact"] for row in rows)
            # parse_math=False: a folder or CPU name with `$...$` would be read as (bad) TeX.
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, parse_math=False)
        ax.set_title(cpu if len(cpu) < 60 else cpu[:57] + "...", fontsize=9, parse_math=False)
        ax.set_xlabel(x_key or "row")
        ax.set_ylabel(y_key.replace("_b", " at batch ") if table["batches"] else "size MB")
        ax.grid(alpha=0.3)
    fig.suptitle("artifacts of compare.md (green: a gate passed, red: failed)", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def write_outputs(out: Path, table: dict) -> None:
    """All three rendered first, then each written beside its name and renamed into place."""
    contents = {
        "compare.csv": render_csv(table).encode(),
        "compare.md": render_markdown(table).encode(),
        "compare.png": render_plot(table),
    }
    for name, data in contents.items():
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, out / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
