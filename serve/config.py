"""Server settings: command line first, then the artifact recipe's `serve` block, then defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

API_KEY_ENV = "SERVE_API_KEY"


@dataclass
class ServeConfig:
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    max_queue: int = 256  # requests waiting for the model; more are refused with 429
    timeout_s: float = 30.0  # per request, queueing included: 504 past it
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


def resolve(cli: dict, manifest: dict) -> ServeConfig:
    recipe = ((manifest.get("recipe") or {}).get("resolved") or {}).get("serve") or {}
    values = {k: recipe[k] for k in RECIPE_KEYS if recipe.get(k) is not None}
    names = {f.name for f in fields(ServeConfig)}
    values.update({k: v for k, v in cli.items() if k in names and v is not None})
    if not values.get("api_key"):
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return ServeConfig(**values)
