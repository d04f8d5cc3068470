"""What the race leaves in the manifest and the artifact: its record (every candidate, the winner,
why each lost) and the plot of its front."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

from optimize.compile.race.cells import served_cell
from optimize.compile.race.choice import won_on
from optimize.compile.race.entry import Entry
from optimize.workload import RequestPoint

log = logging.getLogger(__name__)
PLOT = "race/front.png"  # the race's front in the artifact


def race_record(
    ctx,
    workload,
    entries: list[Entry],
    winner: Entry,
    baseline: dict,
    export: Optional[dict],
    plot: Optional[Path],
    seconds: float,
) -> dict:
    from optimize.evaluate.kernels import int8_gemm_speedup

    lm = bool(winner.metrics)
    for entry in entries:
        log.debug("race: %-28s %s", entry.name, entry.outcome)
    record = {
        "method": "auto",
        "winner": winner.name,
        "won_on": won_on(workload, lm),
        "workload": workload.record(),
        "candidates": [e.report() for e in entries],
        "close_calls": [e.name for e in entries if "within noise" in e.outcome],
        "retimed_points": _retimed_points(entries),
        "seconds": round(seconds, 1),
        "plot": PLOT if plot else None,
        "winner_engine": winner.records.get("engine"),
    }
    if lm:
        return {**record, "baseline": baseline}
    return {
        **record,
        "batch_size": workload.batches[0].key if len(workload.batches) == 1 else None,
        "baseline_p50_ms": baseline,
        "export": export,
        "int8_gemm": int8_gemm_speedup(ctx.threads),
    }


def cut_note(halving: dict) -> Optional[str]:
    """One line naming the candidates successive halving cut after the first served round, and why."""
    cut = halving.get("cut") or {}
    if not cut:
        return None
    said = "; ".join(f"{name}: {why}" for name, why in cut.items())
    return f"successive halving cut {len(cut)} candidate(s) after the first served round ({said})"


def _retimed_points(entries: list[Entry]) -> int:
    """Points the race timed again because other processes took CPU time (all candidates share a run)."""
    for entry in entries:
        timed = entry.latency or entry.metrics.get("requests") or {}
        if timed:
            return sum((t.get("retimes") or 0) > 0 for t in timed.values())
    return 0


def plot_front(entries: list[Entry], workload, path: Path) -> Optional[Path]:
    """The front at every workload point: latency (causal LMs: request time) against accuracy (min
    cosine; perplexity increase), one panel per point, each candidate labelled with its size."""
    lm = any(e.metrics for e in entries)
    points = [p.key for p in (workload.requests if lm else workload.batches)]
    if lm:  # the candidates served at every shape (those that fail accuracy are never timed)
        scored = [e for e in entries if all(k in (e.metrics.get("requests") or {}) for k in points)]
    else:
        scored = [e for e in entries if "cosine_min" in e.fidelity and all(k in e.latency for k in points)]
    if not scored:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    for ax, point in zip(axes[0], points):
        for entry in scored:
            x, y = _front_xy(entry, point, lm)
            shipped = entry.outcome.startswith("won")
            ax.scatter(
                [x],
                [y],
                color="tab:green" if entry.passed else "tab:red",
                marker="*" if shipped else "o",
                s=160 if shipped else 50,
            )
            size = f" ({entry.size_mb:.0f} MB)" if entry.size_mb is not None else ""
            ax.annotate(entry.name + size, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(
            f"request time {point} tokens as served, fewest clients (ms)" if lm else f"p50 at batch {point} (ms)"
        )
        ax.set_ylabel("perplexity increase (%)" if lm else "min cosine vs baseline")
        ax.grid(alpha=0.3)
    fig.suptitle("engine race at each workload point: green passes accuracy, red fails, star ships")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _front_xy(entry: Entry, point: str, lm: bool) -> tuple[float, float]:
    if lm:
        return entry.metrics["requests"][point]["request_ms"], entry.metrics["perplexity_increase_pct"]
    return entry.latency[point]["p50_ms"], entry.fidelity["cosine_min"]


def level_table(race: dict) -> list[list[str]]:
    """The LM race as served: one row per candidate and level, tok/s and TTFT p95 at each shape."""
    shapes = [
        RequestPoint(r["prompt"], r["output"], r.get("weight", 1.0), r.get("kind", "plain")).key
        for r in race["workload"]["requests"]
    ]
    rows = [["candidate", "clients", *(f"{s} tok/s (TTFT p95 ms)" for s in shapes), "served cost", "outcome"]]
    for c in race["candidates"]:
        served = (c.get("metrics") or {}).get("served") or {}
        for level in race["workload"]["concurrency"]:
            cells = [served.get(s, {}).get(level) or {} for s in shapes]
            shown = [served_cell(x) if x else "-" for x in cells]
            cost = f"{c['cost']:.2f}" if c.get("cost") is not None and served else "-"
            rows.append([c["name"], level, *shown, cost, c["outcome"]])
    return rows


def main(argv: list[str]) -> int:
    """python -m optimize.compile.race.report ARTIFACT: the race's wall time and its per-level table."""
    from engines.artifact import ArtifactError, read_manifest

    if len(argv) != 1:
        return refused("usage: python -m optimize.compile.race.report ARTIFACT")
    try:
        manifest = read_manifest(argv[0])
    except ArtifactError as exc:
        return refused(str(exc))
    race = (manifest.get("stages") or {}).get("engine")
    if not isinstance(race, dict) or not isinstance(race.get("candidates"), list) or "seconds" not in race:
        return refused(f"{argv[0]}: its engine was not chosen by a race (no race in the manifest's stages)")
    try:  # a manifest sealed again after an edit passes its digest check with any shape inside
        lines = race_lines(race, manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return refused(f"{argv[0]}: the manifest's race record is malformed ({type(exc).__name__}: {exc})")
    print("\n".join(lines))
    return 0


def race_lines(race: dict, manifest: dict) -> list[str]:
    """The headline, the race's notes and its per-level table, as printed."""
    lines = [f"race {race['seconds']:.0f} s of the run's {manifest['duration_s']:.0f} s; won by {race['winner']}"]
    lines += [f"NOTE: {note}" for note in (race.get("fewer_than_asked"), race.get("served_cut_note")) if note]
    rows = level_table(race)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in [rows[0], ["-" * w for w in widths], *rows[1:]]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return lines


def refused(message: str) -> int:
    """Bad input: one line on stderr, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
