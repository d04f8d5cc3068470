"""Server settings: command line first, then the artifact recipe's `serve` block, then defaults."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

API_KEY_ENV = "SERVE_API_KEY"


@dataclass
class ServeConfig:
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    max_queue: int = 256  # requests waiting for the model; more are refused with 429
    timeout_s: float = 30.0  # per request, queueing included: 504 past it (GENERATION_TIMEOUT_S for LMs)
    max_request_bytes: int = 4 << 20
    max_inputs: int = 2048  # texts or token arrays in one embeddings request
    max_prompt_tokens: int = 0  # causal LMs; 0: the context length less one
    max_tokens: int = 512  # causal LMs: cap on max_tokens
    threads: int = 0  # ONNX Runtime intra-op threads; 0: the CPUs this process may use
    ort_spinning: bool = False  # let idle ONNX Runtime threads spin (steals the event loop's cores)
    api_key: str | None = None
    open_health_metrics: bool = False  # with an API key: leave /v2/health/* and /metrics open
    model_name: str | None = None
    header_timeout_s: float = 10.0  # request headers must be complete within this, or the connection closes
    body_timeout_s: float = 30.0  # the whole request body within this, or 408
    max_connections: int = 1024  # uvicorn's limit_concurrency: past it, 503
    # Causal LMs on an engine that batches continuously (OpenVINO GenAI): sequences decoded together,
    # the KV cache's size, tokens per scheduling step, and whether shared prompt prefixes are reused.
    # max_num_seqs 1 runs one generation at a time through the runner the pipeline measured.
    max_num_seqs: int = 16
    kv_cache_gb: float = 1.0
    max_batched_tokens: int = 512
    prefix_caching: bool = True
    prompt_lookup: bool | None = None  # n-gram speculation (OpenVINO GenAI); None: as the artifact says

    @property
    def max_queue_delay_s(self) -> float:
        return self.max_queue_delay_ms / 1000

    def ort_threads(self) -> int:
        # os.cpu_count() sees the host; the affinity mask is what a container actually grants.
        return self.threads or len(os.sched_getaffinity(0))


# The request timeout of a model that generates, where neither the command line nor the recipe sets
# one. A whole answer of serve's max_tokens (512) at 10-20 tokens/s on a 2-core CPU takes 25-50 s, and
# an engine that batches statically (ONNX Runtime GenAI: 4 sequences) keeps the 16th of 16 clients
# waiting three generations for its first token: on SmolLM2 at 1024 prompt tokens + 128, 11 to 15 of
# 16 requests were 504s at 30 s, none at 300 s. The engine race serves its candidates with this too,
# so what it timed is what the artifact does under serve's defaults.
GENERATION_TIMEOUT_S = 300.0


# Settings an artifact's recipe may carry (recipe.resolved.serve); the command line wins.
RECIPE_KEYS = (
    "max_batch_size",
    "max_queue_delay_ms",
    "max_queue",
    "timeout_s",
    "max_num_seqs",
    "kv_cache_gb",
    "max_batched_tokens",
    "prefix_caching",
    "prompt_lookup",
)


# What each setting a recipe may carry takes: (kind, low, low allowed, high or None). The one check of
# them: `python -m serve`'s flags parse with it (serve/__main__.py), and the plan checks a recipe's
# `serve` block with it (optimize/plan.py), so a recipe cannot record what the server would refuse.
LIMITS: dict[str, tuple[type, float, bool, float | None]] = {
    "max_batch_size": (int, 0, False, None),
    "max_queue_delay_ms": (float, 0, True, None),
    "max_queue": (int, 0, False, None),
    "timeout_s": (float, 0, False, None),
    "max_num_seqs": (int, 1, True, 4096),
    "kv_cache_gb": (float, 0, False, 4096),
    "max_batched_tokens": (int, 1, True, 1 << 20),
    "prefix_caching": (bool, 0, True, None),
}


def number_problem(value, kind: type, low: float, inclusive: bool, high: float | None = None) -> str | None:
    """Why `value` is not a finite number of `kind` above `low` (or at least `low`) and at most `high`;
    None when it is. NaN passes every comparison, and inf overflows uvicorn's timers: both refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
        return f"must be {'a whole number' if kind is int else 'a number'}, got {repr(value)[:40]}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if value < low or (value == low and not inclusive):
        return f"must be {'>=' if inclusive else '>'} {low}, got {repr(value)[:40]}"
    if high is not None and value > high:
        return f"must be <= {high}, got {repr(value)[:40]}"
    return None


def setting_problem(name: str, value) -> str | None:
    """Why `value` cannot be the setting `name` (one of RECIPE_KEYS), or None (None: the default)."""
    if value is None:
        return None
    kind, low, inclusive, high = LIMITS[name]
    if kind is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {repr(value)[:40]}"
    return number_problem(value, kind, low, inclusive, high)


def resolve(cli: dict, manifest: dict) -> ServeConfig:
    recipe = ((manifest.get("recipe") or {}).get("resolved") or {}).get("serve") or {}
    values = {k: recipe[k] for k in RECIPE_KEYS if recipe.get(k) is not None}
    names = {f.name for f in fields(ServeConfig)}
    values.update({k: v for k, v in cli.items() if k in names and v is not None})
    if values.get("timeout_s") is None and generates(manifest):
        values["timeout_s"] = GENERATION_TIMEOUT_S
    if not values.get("api_key"):
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return ServeConfig(**values)


def generates(manifest: dict) -> bool:
    """Whether the artifact's engine format generates text (its requests last whole answers)."""
    from engines import formats

    engine_format = formats.FORMATS.get((manifest.get("engine") or {}).get("format") or "")
    return bool(engine_format and engine_format.serves == "causal_lm")
