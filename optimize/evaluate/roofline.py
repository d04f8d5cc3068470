"""Memory roofline for causal-LM decoding: how fast could greedy decode go if it only had to read memory?

At batch 1 each generated token reads every weight matrix once, plus the KV cache of the tokens so
far; the arithmetic is small next to that, so decode tokens/s can not exceed

    bound_tok_s = bandwidth / (weight_bytes_per_token + kv_bytes_per_token)

and `share = measured decode tok/s / bound_tok_s` says how much of the machine's memory bandwidth a
runtime turns into tokens.

What is counted as read per token:
- every weight tensor a matrix multiply (or any non-gather op) consumes, whole, at its stored size
  (MatMulNBits: the packed 4/8-bit weights, their scales and zero points; FP32 weights at 4 bytes);
- tables that are only gathered by token id or position (the embedding table read by Gather or
  GatherBlockQuantized, rotary cos/sin caches read by position): one row per token, since that is
  all a lookup touches. A table that is gathered *and* multiplied (an embedding tied to the LM head
  and shared in the graph) is read whole by the multiply and counted once, whole;
- the KV cache: layers x 2 (K and V) x kv_heads x head_dim x bytes per element x context tokens.

Ignored: activations (a few KB per token at batch 1), and the caches: a model larger than the
last-level cache is streamed from DRAM each token; a model that fits could beat this bound.

Bandwidth is measured at run time: numpy sums over a float64 buffer 4x the L3 cache, split over the
run's threads (numpy releases the GIL in reductions), best of N repeats in about half a second.
numpy's sum does not use BLAS, so OPENBLAS_NUM_THREADS and friends do not change it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import numpy as np

from engines.pytorch.runner import torch_weight_bytes  # noqa: F401
from engines.weights import (  # noqa: F401  (re-exported: the roofline's inputs)
    KVShape,
    WeightBytes,
    genai_read_bytes,
    kv_shape_from_genai_config,
    kv_shape_from_hf_config,
    onnx_kv_dtype_bytes,
    onnx_weight_bytes,
    openvino_folder_read_bytes,
    openvino_weight_bytes,
)

NOT_KNOWN = "not known"

# ---------------------------------------------------------------- bandwidth


def l3_bytes(default: int = 32 << 20) -> int:
    """The last-level cache size from sysfs (Linux), else `default`."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or default


def read_bandwidth(threads: int = 1, budget_s: float = 0.5, buffer_bytes: int | None = None, repeats: int = 20) -> dict:
    """Memory read bandwidth in GB/s (1e9 bytes/s): sum of a float64 buffer 4x the L3 cache (at least
    64 MiB), split in `threads` parts summed concurrently; best of up to `repeats` passes within
    `budget_s` (one pass always)."""
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, int(threads))
    size = buffer_bytes or max(4 * l3_bytes(), 64 << 20)
    data = np.ones(size // 8, dtype=np.float64)  # written once: every page is resident
    parts = np.array_split(data, threads)
    best, passes = float("inf"), 0
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        while passes < repeats and (passes == 0 or time.perf_counter() - started < budget_s):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
            passes += 1
    return {
        "bandwidth_gb_s": data.nbytes / best / 1e9,
        "buffer_mb": data.nbytes / 2**20,
        "threads": threads,
        "passes": passes,
        "method": "numpy float64 sum, best pass",
    }


# ---------------------------------------------------------------- the roofline


def roofline(
    weight: Optional[WeightBytes],
    kv: Optional[KVShape],
    context_tokens: int,
    bandwidth_gb_s: float,
    decode_tok_s: Optional[float],
) -> dict:
    """The figures a report carries; weight or kv None: 'not known' and no bound."""
    if weight is None or kv is None:
        missing = " and ".join(n for n, v in (("weight bytes", weight), ("KV shape", kv)) if v is None)
        return {
            "bandwidth_gb_s": bandwidth_gb_s,
            "bound_tok_s": None,
            "share": None,
            "weight_bytes_per_token": weight.per_token if weight else None,
            "kv_bytes_per_token": kv.bytes_per_token(context_tokens) if kv else None,
            "context_tokens": context_tokens,
            "note": f"{missing} {NOT_KNOWN} for this runner",
        }
    kv_bytes = kv.bytes_per_token(context_tokens)
    per_token = weight.per_token + kv_bytes
    bound = bandwidth_gb_s * 1e9 / per_token
    return {
        "weight_bytes_per_token": weight.per_token,
        "weight_bytes_stored": weight.stored,
        "kv_bytes_per_token": kv_bytes,
        "context_tokens": context_tokens,
        "kv_shape": asdict(kv),
        "bandwidth_gb_s": bandwidth_gb_s,
        "bound_tok_s": bound,
        "share": None if decode_tok_s is None else decode_tok_s / bound,
        "counted": weight.counted,
        "gathered_tables": weight.gathered_tables,
    }


def runner_read_bytes(runner) -> tuple[Optional[WeightBytes], Optional[KVShape]]:
    """What a runner reads per token, where it can say: its `weight_bytes_per_token()` (a WeightBytes)
    and `kv_shape()` (a KVShape); a runner without them whose folder (`runner.dir`) holds an OpenVINO
    GenAI model is read from the folder (KV precision from its `properties`). Otherwise, or on any
    failure: None, and the report says 'not known'."""
    if not hasattr(runner, "weight_bytes_per_token") and hasattr(runner, "dir"):
        folder = Path(runner.dir)
        if (folder / "openvino_model.xml").is_file() and (folder / "config.json").is_file():
            kv_precision = (getattr(runner, "properties", None) or {}).get("KV_CACHE_PRECISION", "f32")
            try:
                return openvino_folder_read_bytes(folder, kv_precision)
            except Exception:
                return None, None
    found: list[Any] = []
    for method in ("weight_bytes_per_token", "kv_shape"):
        try:
            found.append(getattr(runner, method)())
        except Exception:  # AttributeError included: a runner that cannot tell
            found.append(None)
    return found[0], found[1]
