"""The end-of-run report: baseline vs candidate, the gate's checks, the artifact path."""
from __future__ import annotations


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def metrics_rows(metrics: dict) -> list[list[str]]:
    base, cand = metrics["baseline"], metrics["candidate"]
    rows = [["metric", f"baseline ({base.get('engine')} {base.get('precision')})",
             f"candidate ({cand.get('engine')} {cand.get('precision')})", "ratio"]]
    fid = cand.get("fidelity", {})
    for key, label in (("cosine_min", "cosine vs baseline (min)"), ("cosine_mean", "cosine vs baseline (mean)"),
                       ("topk_agreement", f"top-{fid.get('top_k', 'k')} neighbour agreement"),
                       ("max_abs_error", "max abs error")):
        if key in fid:
            rows.append([label, "1 (reference)", _fmt(fid[key], 4), ""])
    for batch, stats in cand.get("latency", {}).items():
        b = base["latency"][batch]
        for pct in ("p50_ms", "p95_ms"):
            rows.append([f"latency {pct[:3]} ms, batch {batch}", _fmt(b[pct]), _fmt(stats[pct]),
                         f"{b[pct] / stats[pct]:.2f}x" if pct == "p50_ms" else ""])
        rows.append([f"throughput/s, batch {batch}", _fmt(b["throughput_per_s"], 1),
                     _fmt(stats["throughput_per_s"], 1), ""])
    rows += [[str(cell) for cell in row] for row in metrics.get("table", [])]  # rows a task adds
    if "timing" in cand:  # the conditions the latency figures were measured in
        rows.append(["CPU used by other processes while timing", "", f"{cand['timing']['other_cpu_share']:.0%}", ""])
    rows.append(["size on disk MB", _fmt(base["size_mb"], 1), _fmt(cand["size_mb"], 1),
                 f"{cand['size_mb'] / base['size_mb']:.2f}x"])
    if "peak_memory_mb" in cand:
        rows.append(["peak memory MB", _fmt(base["peak_memory_mb"], 1), _fmt(cand["peak_memory_mb"], 1), ""])
    return rows


def check_rows(gate: dict) -> list[list[str]]:
    rows = [["check", "metric", "value", "threshold", "result"]]
    for c in gate["checks"]:
        rows.append([c["name"], c["metric"], _fmt(c["value"], 4), f"{c['comparison']} {c['threshold']}",
                     ("PASS" if c["passed"] else "FAIL") + (f" ({c['note']})" if c["note"] else "")])
    return rows


def render(manifest: dict, path) -> str:
    threads = manifest["metrics"].get("threads", {})
    parts = [
        f"recipe {manifest['recipe']['name']}: {manifest['model']['source']}",
        _table(metrics_rows(manifest["metrics"])),
        f"(threads: {threads.get('requested')}, cpu count {threads.get('cpu_count')}; "
        f"{manifest['evaluation'].get('count')} evaluation samples)",
        "",
        _table(check_rows(manifest["gate"])),
        "",
        f"gate: {'PASSED' if manifest['gate']['passed'] else 'FAILED'}",
        f"artifact: {path}",
    ]
    return "\n".join(parts)
