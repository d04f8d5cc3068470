"""Whether a model held in bf16 or fp16 scores faster in that precision than in FP32 on this CPU.

The baseline's log-probabilities are FP32 by default (fp32_compute upcasts each module for its own
forward), which keeps its token-level fidelity reference exact. Where exactness buys nothing a
reader can see (a multiple-choice item's right or wrong answer, which lm-eval computes in a bf16
checkpoint's own precision), a CPU with native bf16 dot products (AVX-512 BF16, AMX) computes a
Llama-3.2-1B layer 3.6-4x faster in bf16 (AMD Zen 4), while one without them (AVX2 only) converts
bf16 in software and may gain nothing. So the choice is measured here, on one of the model's own
weight matrices, not read from the CPU's flags.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

# bf16/fp16 scoring is chosen where it is at least this much faster than the FP32 path (upcast and
# FP32 matmul): below it the speed does not pay for giving up the FP32 model's exact scores.
WORTH_IT = 1.5


def held_precision(model) -> str:
    """The torch dtype name the model's first parameter is held in ('float32' for an empty model)."""
    first = next(model.parameters(), None)
    return str(first.dtype).removeprefix("torch.") if first is not None else "float32"


def typical_weight(model):
    """The weight of the most common Linear shape (a decoder layer's MLP projection in a transformer),
    not the largest one: an 8B model's LM head alone would take 2 GB to upcast for the measurement."""
    import torch

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not weights:
        return None
    counts = Counter(tuple(w.shape) for w in weights)
    shape = max(counts, key=lambda s: (counts[s], s[0] * s[1]))
    return next(w for w in weights if tuple(w.shape) == shape)


def half_compute_speedup(model, rows: int = 64, repeats: int = 5) -> float:
    """How many times faster the model's typical Linear is in its held precision than upcast to FP32
    and computed there, for `rows` tokens (medians of `repeats` after one warm-up); 1.0 for a model
    held in FP32, one without a Linear, or one on a GPU (what is measured here is this CPU)."""
    import torch

    weight = typical_weight(model)
    if weight is None or weight.dtype == torch.float32 or weight.device.type != "cpu":
        return 1.0
    x = torch.randn(rows, weight.shape[1])
    half_x, scratch = x.to(weight.dtype), torch.empty(weight.shape, dtype=torch.float32)

    def fp32_path():
        torch.nn.functional.linear(x, scratch.copy_(weight))

    def half_path():
        torch.nn.functional.linear(half_x, weight)

    with torch.inference_mode():
        return _median_seconds(fp32_path, repeats) / _median_seconds(half_path, repeats)


def _median_seconds(call, repeats: int) -> float:
    call()  # warm-up: the kernel's first call picks and builds its primitive
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return max(statistics.median(seconds), 1e-9)


def faster_precision(model) -> tuple[str, float]:
    """(the precision to compute in where exactness is not needed, its speed over FP32's): the one the
    weights are held in where that is WORTH_IT times faster here, else 'float32'."""
    held = held_precision(model)
    if held == "float32":
        return "float32", 1.0
    speedup = half_compute_speedup(model)
    return (held if speedup >= WORTH_IT else "float32"), speedup
