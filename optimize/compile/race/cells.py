"""What the race's report shows of each candidate, for encoders and causal LMs alike: its cells (build
time, then the task's own figures), how each LM engine serves concurrent requests, and what it
measured as served at every concurrency level.

The entries are read, never imported: entry, lm and choice all use these cells, so this module sits
below them.
"""

from __future__ import annotations

# How each batching kind of an LM engine format (engines/formats.py) serves concurrent requests on CPU
# (python -m serve; serve/README.md measures both): OpenVINO GenAI's pipeline batches continuously,
# onnxruntime-genai's Engine only statically (at most 4 sequences, new requests between batches), since
# its continuous path needs PagedAttention, which its builder makes for CUDA and WebGPU only.
BATCHING_WORDS = {
    "continuous": "continuous batching",
    "static": "static batches of at most 4",
    "none": "one at a time",
}


def serving(entry) -> str:
    """How the entry's engine serves concurrent requests, in words."""
    return BATCHING_WORDS[batching(entry)]


def batching(entry) -> str:
    """How the entry's engine batches when served ("static", "continuous", or "none": one sequence at a
    time): by its built engine's format, else by the formats its method builds (every LM method builds one)."""
    from engines import formats
    from optimize import registry

    built = (entry.model.engine or {}).get("format") if entry.model is not None else None
    names = (built,) if built else registry.get("engine", entry.spec.engine).formats(None, None)
    rows = [formats.FORMATS[n] for n in names if n in formats.FORMATS]
    return rows[0].batching if rows else "none"


def columns(entry) -> dict:
    """What the report shows of one candidate: its build time, then the task's own figures."""
    return {
        "build s": build_words(entry),
        "build peak GB": _peak_words(entry),
        **(lm_cells(entry) if entry.metrics else encoder_cells(entry)),
    }


def _peak_words(entry) -> str:
    """The most its build's process tree held (a forked child shares the race's pages: counted once)."""
    return f"{entry.build_peak_gb:.1f}" if entry.build_peak_gb else "-"


def build_words(entry) -> str:
    if entry.model is None:
        return "-"
    if entry.cached:
        return "cached"
    rebuilt = ""
    if entry.cache_rebuilt:  # a new version of the code is routine; anything else is a copy gone bad
        stale = "another version" in entry.cache_rebuilt
        rebuilt = " (cached copy from another version)" if stale else " (cached copy failed its check)"
    return f"{entry.build_s:.0f}" + (f" (over {entry.budget_s:.0f})" if entry.over_budget else "") + rebuilt


def encoder_cells(entry) -> dict:
    cells = {
        "cosine min": _fmt(entry.fidelity.get("cosine_min")),
        "cosine mean": _fmt(entry.fidelity.get("cosine_mean")),
    }
    for batch, timing in entry.latency.items():
        cells[f"p50 ms b{batch} (x base)"] = f"{timing['p50_ms']:.2f} ({timing['x_baseline']:.2f}x)"
    if entry.cost is not None:
        cells["workload ms (weighted p50)"] = f"{entry.cost:.2f}"
    return cells


def lm_cells(entry) -> dict:
    m = entry.metrics
    generation = m.get("generation") or {}
    return {
        "perplexity (+%)": f"{m['perplexity']:.3f} ({m['perplexity_increase_pct']:+.1f}%)",
        "lm-eval drop pts": f"{m['lm_eval_drop_pts']:.1f}" if "lm_eval_drop_pts" in m else "-",
        **_fidelity_cell(m.get("fidelity")),
        "TTFT p50 ms": f"{generation['ttft_ms']['p50']:.1f}" if generation else "-",
        "decode tok/s p50 (x base)": (
            f"{generation['decode_tok_s']['p50']:.1f} ({m['decode_speedup']:.2f}x)" if generation else "-"
        ),
        "generation ms": f"{m['generation_ms']:.0f}" if "generation_ms" in m else "-",
        "serves concurrent requests": serving(entry),
        **_shape_cells(m.get("requests") or {}),
        **_served_cells(m.get("served") or {}),
        **_cost_cell(entry),
    }


def _fidelity_cell(fidelity: dict | None) -> dict:
    """The race's KLD screen: mean KL divergence and top-1 agreement on the screen's tokens."""
    if not fidelity:
        return {}
    figures = f"{fidelity['mean_kld']:.4f} / {100 * fidelity['top1_agreement']:.1f}%"
    return {f"KLD / top-1 ({fidelity['tokens']} tok)": figures}


def _cost_cell(entry) -> dict:
    if entry.cost is None:
        return {}
    if "served" in entry.metrics:
        return {"served cost (1 = best at every level)": f"{entry.cost:.2f}"}
    return {"workload ms (weighted)": f"{entry.cost:.0f}"}


def _served_cells(served: dict) -> dict:
    """As served (race/served.py): at each concurrency level, aggregate output tokens/s and TTFT p95 at
    each shape (shapes joined by ' | ', in the workload's order)."""
    levels = list(dict.fromkeys(level for by_level in served.values() for level in by_level))
    cells = {}
    for level in levels:
        shown = [served_cell(by_level.get(level) or {}) for by_level in served.values()]
        cells[f"served {level} clients tok/s (TTFT p95 ms)"] = " | ".join(shown)
    return cells


def served_cell(cell: dict) -> str:
    """Tokens/s (TTFT p95 ms) of one served cell ("derived" where it was not driven: an engine served one
    sequence at a time, race/served.py); where requests failed, how many of how many."""
    if cell.get("failed") or cell.get("tokens_per_s") is None:
        return (
            f"failed {cell['failed']}/{cell['requests']}" if cell.get("failed") and cell.get("requests") else "failed"
        )
    shown = f"{cell['tokens_per_s']:.0f} ({cell['ttft_p95_ms']:.0f})"
    return f"{shown} derived" if cell.get("derived") else shown


def _shape_cells(requests: dict) -> dict:
    """TTFT, decode and request time at each shape, when the workload has several."""
    if len(requests) < 2:
        return {}
    cells = {}
    for shape, r in requests.items():
        g = r["generation"]
        cells[f"TTFT ms {shape}"] = f"{g['ttft_ms']['p50']:.1f}"
        cells[f"decode tok/s {shape}"] = f"{g['decode_tok_s']['p50']:.1f} ({r['decode_speedup']:.2f}x)"
        cells[f"request ms {shape}"] = f"{r['request_ms']:.0f}"
    return cells


def _fmt(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
