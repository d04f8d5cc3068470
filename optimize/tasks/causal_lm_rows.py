"""The causal-LM task's rows of the end-of-run table: perplexity, token-level fidelity (KLD, top-1
agreement, RMS Δp), standard tasks with their paired intervals and flips, lm-eval accuracy, generation
speed per request shape, the roofline, and the layers kept at higher precision."""

from __future__ import annotations

from optimize.evaluate.roofline import NOT_KNOWN


def _layers_in_words(nodes: list[str]) -> str:
    """['layers.0/attn/qkv_proj', 'layers.3/attn/qkv_proj', 'lm_head'] -> 'attn/qkv_proj 0,3; lm_head'."""
    import re

    by_kind: dict[str, list[str | None]] = {}
    for node in nodes:
        match = re.match(r".*layers\.(\d+|\*)/(.*)", node)
        kind, layer = (match.group(2), match.group(1)) if match else (node, None)
        by_kind.setdefault(kind, []).append(layer)
    parts = [kind if layers == [None] else f"{kind} {_ranges(layers)}" for kind, layers in by_kind.items()]
    return "; ".join(parts)


def _ranges(layers: list) -> str:
    """['0', '1', '2', '6'] -> '0-2,6'."""
    if not all(layer and layer.isdigit() for layer in layers):
        return ",".join(layer for layer in layers if layer)
    numbers = sorted(int(layer) for layer in layers)
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _roofline_rows(b: dict, c: dict) -> list[list[str]]:
    rb, rc = b.get("roofline"), c.get("roofline")
    if not rb or not rc:
        return []

    def mb(r, key):
        return NOT_KNOWN if r.get(key) is None else f"{r[key] / 1e6:.1f}"

    def ratio(key, style):
        return style(rc[key] / rb[key]) if rb.get(key) and rc.get(key) is not None else ""

    rows = [
        [
            "weights read per token MB",
            mb(rb, "weight_bytes_per_token"),
            mb(rc, "weight_bytes_per_token"),
            ratio("weight_bytes_per_token", lambda x: f"{x:.2f}x"),
        ],
        [
            f"KV cache read per token MB ({rc['context_tokens']} tokens)",
            mb(rb, "kv_bytes_per_token"),
            mb(rc, "kv_bytes_per_token"),
            "",
        ],
        [
            "memory read bandwidth GB/s (measured)",
            fmt(rb["bandwidth_gb_s"], 1),
            fmt(rc["bandwidth_gb_s"], 1),
            f"{rc['bandwidth']['threads']} threads, others {rc['bandwidth']['other_cpu_share']:.0%} CPU",
        ],
        [
            "roofline bound decode tok/s",
            fmt_known(rb["bound_tok_s"], 1),
            fmt_known(rc["bound_tok_s"], 1),
            ratio("bound_tok_s", lambda x: f"{x:.2f}x"),
        ],
    ]
    if rb.get("share") is not None or rc.get("share") is not None:
        rows.append(["decode p50 share of bound", _pct(rb), _pct(rc), _limit(rc)])
    return rows


# At or above this share of the bandwidth bound, decode is taken to be limited by memory reads.
MEMORY_BOUND_SHARE = 0.5


def _limit(r: dict) -> str:
    """What the measured share says limits the candidate's decode."""
    if r.get("share") is None:
        return ""
    if r["share"] >= MEMORY_BOUND_SHARE:
        return "memory-bound: reading the weights and KV cache limits decode"
    return "not memory-bound: compute and per-token overhead limit decode"


def fmt_known(value, digits=2) -> str:
    return NOT_KNOWN if value is None else f"{value:.{digits}f}"


def _pct(r: dict) -> str:
    if r.get("share") is not None:
        return f"{r['share']:.0%}"
    return NOT_KNOWN if r.get("bound_tok_s") is None else "-"


def fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _shape_rows(base: dict, cand: dict, shapes: list[str]) -> list[list[str]]:
    """Every request shape of the workload: request time, then TTFT and decode p50 of the shapes
    after the first (whose rows come before, with their p95s)."""
    rows = []
    for i, shape in enumerate(shapes):
        b, c = base[shape], cand[shape]
        rows.append([f"request time p50 ms ({shape})", fmt(b["request_ms"], 0), fmt(c["request_ms"], 0), ""])
        rows[-1][3] = f"{b['request_ms'] / c['request_ms']:.2f}x"
        if i == 0:
            continue
        bg, cg = b["generation"], c["generation"]
        rows.append([f"time to first token p50 ms ({shape})", fmt(bg["ttft_ms"]["p50"]), fmt(cg["ttft_ms"]["p50"]), ""])
        rows[-1][3] = f"{c['ttft_speedup']:.2f}x"
        rows.append(
            [
                f"decode tok/s p50 ({shape})",
                fmt(bg["decode_tok_s"]["p50"], 1),
                fmt(cg["decode_tok_s"]["p50"], 1),
                f"{c['decode_speedup']:.2f}x",
            ]
        )
    return rows


def _fidelity_rows(c: dict) -> list[list[str]]:
    """Token-level fidelity to the baseline, as llama.cpp's --kl-divergence reports it (the baseline
    column is the reference itself: KLD 0, agreement 100%)."""
    f = c.get("fidelity")
    if not f:
        return []
    kinds = ", ".join(f"{k} {v['mean_kld']:.4f}" for k, v in (f.get("by_kind") or {}).items())
    tokens = f"{f['tokens']:,} tokens" + (f"; by kind {kinds}" if kinds else "")
    return [
        ["mean KLD vs baseline (nats)", "0", f"{f['mean_kld']:.4f}", tokens],
        ["99th-percentile KLD (nats)", "0", f"{f['p99_kld']:.3f}", ""],
        ["top-1 agreement with baseline", "100%", f"{100 * f['top1_agreement']:.1f}%", ""],
        [
            "RMS change of p(correct token)",
            "0",
            f"{f['rms_delta_p_pct']:.2f} pts",
            f"mean {f['mean_delta_p_pct']:+.2f} pts",
        ],
    ]


def _task_rows(c: dict) -> list[list[str]]:
    """Each standard task's two scores, the drop with its paired 95% interval and the flips each way."""
    tasks = c.get("standard_tasks")
    if not tasks:
        return []
    rows = []
    for name, t in [*tasks["tasks"].items(), ("pooled", tasks["pooled"])]:
        low, high = t["interval"]["low"], t["interval"]["high"]
        rows.append(
            [
                f"{name} ({t['items']} items)",
                fmt(t["baseline"], 4),
                fmt(t["candidate"], 4),
                f"drop {t['drop_pts']:+.1f} pts [{low:+.1f}, {high:+.1f}], flips -{t['lost']}/+{t['gained']}",
            ]
        )
    return rows


def table_rows(metrics: dict) -> list[list[str]]:
    """Rows for the end-of-run table: [metric, baseline, candidate, ratio]."""
    b, c = metrics["baseline"], metrics["candidate"]
    rows = [
        [
            "perplexity (held-out)",
            fmt(b["perplexity"], 3),
            fmt(c["perplexity"], 3),
            f"{c['perplexity_increase_pct']:+.1f}%",
        ]
    ]
    for task, acc in c.get("lm_eval", {}).items():
        rows.append(
            [
                f"lm-eval {task} acc",
                fmt(b["lm_eval"][task], 4),
                fmt(acc, 4),
                f"{(acc - b['lm_eval'][task]) * 100:+.1f} pts",
            ]
        )
    rows += _fidelity_rows(c)
    rows += _task_rows(c)
    if "generation" in c:
        bg, cg = b["generation"], c["generation"]
        shapes = list(c.get("requests") or {})
        at = f" ({shapes[0]})" if len(shapes) > 1 else ""  # several shapes: the rows say which
        for pct in ("p50", "p95"):
            rows.append(
                [
                    f"time to first token {pct} ms{at}",
                    fmt(bg["ttft_ms"][pct]),
                    fmt(cg["ttft_ms"][pct]),
                    f"{bg['ttft_ms'][pct] / cg['ttft_ms'][pct]:.2f}x" if pct == "p50" else "",
                ]
            )
        for pct in ("p50", "p95"):
            rows.append(
                [
                    f"decode tok/s {pct}{at}",
                    fmt(bg["decode_tok_s"][pct], 1),
                    fmt(cg["decode_tok_s"][pct], 1),
                    f"{cg['decode_tok_s'][pct] / bg['decode_tok_s'][pct]:.2f}x" if pct == "p50" else "",
                ]
            )
        if shapes[1:]:
            rows += _shape_rows(b["requests"], c["requests"], shapes)
        if b.get("timed_in"):  # only the candidate was timed now (causal_lm._speed_metrics)
            rows.append(["baseline timed in", b["timed_in"], "", ""])
    else:
        rows.append(["decode speed", "-", "-", c.get("speed_note", "not measured")])
    rows += _roofline_rows(b, c)
    for precision, info in c.get("layer_precision", {}).items():
        rows.append([f"weights kept at {precision}", "", f"{info['count']} nodes", _layers_in_words(info["nodes"])])
    rows.append(["greedy sample", repr(b["sample"]["continuation"][:40]), repr(c["sample"]["continuation"][:40]), ""])
    return rows
