"""The end-of-run report: baseline vs candidate, the gate's checks, the artifact path."""

from __future__ import annotations

from optimize.evaluate.benchmark import RETIME_SHARE


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
    rows = [
        [
            "metric",
            f"baseline ({base.get('engine')} {base.get('precision')})",
            f"candidate ({cand.get('engine')} {cand.get('precision')})",
            "ratio",
        ]
    ]
    fid = cand.get("fidelity", {})
    for key, label in (
        ("cosine_min", "cosine vs baseline (min)"),
        ("cosine_mean", "cosine vs baseline (mean)"),
        ("topk_agreement", f"top-{fid.get('top_k', 'k')} neighbour agreement"),
        ("max_abs_error", "max abs error"),
    ):
        if key in fid:
            rows.append([label, "1 (reference)", _fmt(fid[key], 4), ""])
    for batch, stats in cand.get("latency", {}).items():
        b = base["latency"][batch]
        for pct in ("p50_ms", "p95_ms"):
            rows.append(
                [
                    f"latency {pct[:3]} ms, batch {batch}",
                    _fmt(b[pct]),
                    _fmt(stats[pct]),
                    f"{b[pct] / stats[pct]:.2f}x" if pct == "p50_ms" else "",
                ]
            )
        rows.append(
            [f"throughput/s, batch {batch}", _fmt(b["throughput_per_s"], 1), _fmt(stats["throughput_per_s"], 1), ""]
        )
    rows += [[str(cell) for cell in row] for row in metrics.get("table", [])]  # rows a task adds
    if "timing" in cand:  # the conditions the latency figures were measured in
        rows.append(["CPU used by other processes while timing", "", f"{cand['timing']['other_cpu_share']:.0%}", ""])
        if "retimed_points" in cand["timing"]:
            rows.append(
                [
                    f"points timed again (others above {RETIME_SHARE:.0%} of the CPUs)",
                    "",
                    f"{cand['timing']['retimed_points']} of {len(cand['timing'].get('points') or {})}",
                    "",
                ]
            )
    rows.append(
        [
            "size on disk MB",
            _fmt(base["size_mb"], 1),
            _fmt(cand["size_mb"], 1),
            f"{cand['size_mb'] / base['size_mb']:.2f}x",
        ]
    )
    if "peak_memory_mb" in cand:
        rows.append(["peak memory MB", _fmt(base["peak_memory_mb"], 1), _fmt(cand["peak_memory_mb"], 1), ""])
    return rows


def check_rows(gate: dict) -> list[list[str]]:
    rows = [["check", "metric", "value", "threshold", "result"]]
    for c in gate["checks"]:
        rows.append(
            [
                c["name"],
                c["metric"],
                _fmt(c["value"], 4),
                f"{c['comparison']} {c['threshold']}",
                ("PASS" if c["passed"] else "FAIL") + (f" ({c['note']})" if c["note"] else ""),
            ]
        )
    return rows


def race_rows(race: dict) -> list[list[str]]:
    """The engine race: every candidate with the task's figures (accuracy, speed), size and outcome."""
    columns = list(dict.fromkeys(k for c in race["candidates"] for k in c.get("columns") or {}))
    rows = [["candidate", "precision", "INT8/float nodes", *columns, "size MB", "outcome"]]
    for c in race["candidates"]:
        kernels, cells = c.get("kernels") or {}, c.get("columns") or {}
        nodes = f"{kernels['int8']}/{kernels['float']}" if kernels else "-"
        if "reverted" in kernels:  # layers an accuracy search put back to float
            nodes += f" ({kernels['reverted']} reverted)"
        rows.append(
            [
                c["name"],
                str(c.get("precision") or "-"),
                nodes,
                *(cells.get(k, "-") for k in columns),
                _fmt(c.get("size_mb"), 1),
                c["outcome"] + (f" (its search {c['search_stopped']})" if c.get("search_stopped") else ""),
            ]
        )
    return rows


def environment_lines(manifest: dict) -> list[str]:
    """The CPU the figures came from, and what INT8 buys on it (measured in this run)."""
    cpu = (manifest.get("environment") or {}).get("cpu") or {}
    lines = [
        f"CPU: {cpu.get('model', 'unknown')}, {cpu.get('cores')} cores, features: "
        f"{', '.join(cpu.get('features') or []) or 'none of note'}"
    ]
    stages = manifest.get("stages") or {}
    probe = (stages.get("engine") or {}).get("int8_gemm") or (stages.get("quantize") or {}).get("int8_gemm")
    if probe:
        from optimize.evaluate.kernels import describe_int8

        lines.append(describe_int8(probe))
    quantize = stages.get("quantize") or {}
    if quantize.get("op_types_from") == "graph":  # the method's op types were not set: say which it took
        lines.append(f"quantized op types: {', '.join(quantize['op_types'])} (the graph's weighted ops)")
    kernels = quantize.get("kernels")
    if kernels:
        lines.append(
            f"weighted nodes running INT8 kernels: {kernels['int8']}, float: {kernels['float']} "
            f"({', '.join(f'{op} {n}' for op, n in sorted(kernels['by_op'].items()))})"
        )
    return lines


def baseline_lines(metrics: dict) -> list[str]:
    """What the baseline is (a GGUF file dequantized, or a full-precision checkpoint), in one line."""
    statement = (metrics["baseline"].get("reference") or {}).get("statement")
    if not statement:
        return []
    tasks_in = ((metrics["candidate"].get("standard_tasks") or {}).get("scored_in") or {}).get("baseline")
    if tasks_in not in (None, "float32"):  # TorchLM.scored_in: where this CPU computes the held precision faster
        statement += f"; its standard tasks answered in {tasks_in}, faster here"
    return [f"baseline: {statement}"]


def race_notes(race: dict) -> list[str]:
    """What the reader must know before the race table names the winner: fewer candidates than asked,
    timing the budget left noisier, candidates successive halving cut."""
    notes = [race["fewer_than_asked"]] if race.get("fewer_than_asked") else []
    timing = race.get("timing") or {}
    if timing.get("retimes_cut"):
        notes.append(
            f"the machine was busy while timing batch {', '.join(timing['retimes_cut'])} and the race's timing "
            f"budget ({timing['budget_s']:.0f} s) left no time to time it again: those figures are noisier"
        )
    if race.get("served_cut_note"):
        notes.append(race["served_cut_note"])
    return [f"NOTE: {note}" for note in notes]


def render(manifest: dict, path) -> str:
    threads = manifest["metrics"].get("threads", {})
    race = (manifest.get("stages") or {}).get("engine") or {}
    parts = [f"recipe {manifest['recipe']['name']}: {manifest['model']['source']}"]
    if race.get("method") == "auto":
        parts += [f"engine race ({race['seconds']:.0f} s; won on {race['won_on']}):"]
        parts += [*race_notes(race), _table(race_rows(race)), ""]
    parts += [
        _table(metrics_rows(manifest["metrics"])),
        *baseline_lines(manifest["metrics"]),
        f"(threads: {threads.get('requested')}, cpu count {threads.get('cpu_count')}; "
        f"{manifest['evaluation'].get('count')} evaluation samples)",
        *environment_lines(manifest),
        "",
        _table(check_rows(manifest["gate"])),
        "",
        f"gate: {'PASSED' if manifest['gate']['passed'] else 'FAILED'}",
        f"artifact: {path}",
    ]
    return "\n".join(parts)
