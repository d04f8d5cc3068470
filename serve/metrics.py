"""Prometheus metrics (prometheus_client, one registry per app so tests can build several apps).

Endpoint labels are route templates ("/v2/models/{name}/infer"), never raw paths: a client that
probes random URLs must not be able to grow the label set without bound.
"""

from __future__ import annotations

# Latency buckets in seconds: sub-millisecond health checks up to generation runs of a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Per-token times: a decode step of a small model on a CPU (a few ms) up to a stalled stream.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

# What an inference gateway's endpoint picker (Gateway API Inference Extension, llm-d) reads from
# /metrics, by the flag (or engineConfigs key) that names each metric for it, and the type it expects.
# Its defaults are vLLM's names; pointing these at the names here is the whole integration.
GATEWAY_METRICS = {
    "total-queued-requests-metric": ("serve_num_requests_waiting", "gauge"),
    "total-running-requests-metric": ("serve_num_requests_running", "gauge"),
    "kv-cache-usage-percentage-metric": ("serve_kv_cache_usage_perc", "gauge"),  # a fraction, 0 to 1
    "cache-info-metric": ("serve_cache_config_info", "gauge"),  # labels block_size, num_gpu_blocks
}


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "serve_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "serve_request_duration_seconds",
            "Time from request to last byte of the response",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("serve_requests_in_flight", "Requests being handled now", registry=r)
        self.queue_depth = Gauge("serve_queue_depth", "Requests waiting for the model", registry=r)
        self.queue_wait = Histogram(
            "serve_queue_wait_seconds",
            "Time a request waited before its batch ran",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "serve_batch_size", "Rows per model call (dynamic batching)", buckets=BATCH_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "serve_time_to_first_token_seconds",
            "Causal LMs: request accepted to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_per_s = Histogram(
            "serve_generation_tokens_per_second",
            "Causal LMs: generated tokens per second of decoding, per request",
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter("serve_generated_tokens", "Causal LMs: tokens generated", registry=r)
        self.add_generation_metrics(r)
        self.add_capacity_metrics(r)
        self.prompt_tokens = Counter("serve_prompt_tokens", "Tokens read from prompts and inputs", registry=r)
        self.ready = Gauge("serve_model_ready", "1 once the model is loaded and serving", registry=r)

    def add_generation_metrics(self, r) -> None:
        """Causal LMs under concurrent load, named after vLLM's (what dashboards already graph)."""
        from prometheus_client import Counter, Gauge, Histogram

        self.itl = Histogram(
            "serve_inter_token_latency_seconds",
            "Causal LMs: time between consecutive tokens of one stream",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "serve_time_per_output_token_seconds",
            "Causal LMs: per request, decode time after the first token divided by the tokens after it",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "serve_e2e_request_latency_seconds",
            "Causal LMs: request accepted to its last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "serve_request_queue_time_seconds",
            "Causal LMs: request accepted to handed to the engine",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "serve_generation_tokens",
            "Causal LMs: tokens generated, streams cut short included (serve_generated_tokens counts finished ones)",
            registry=r,
        )
        self.running = Gauge("serve_num_requests_running", "Causal LMs: sequences in the engine now", registry=r)
        self.waiting = Gauge("serve_num_requests_waiting", "Causal LMs: requests waiting for the engine", registry=r)
        self.kv_cache_usage = Gauge(
            "serve_kv_cache_usage_perc", "Causal LMs: fraction of the KV cache's blocks in use (0 to 1)", registry=r
        )
        self.prefix_queries = Counter(
            "serve_prefix_cache_queries",
            "Causal LMs with prefix caching: prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "serve_prefix_cache_hits",
            "Causal LMs with prefix caching: prompt tokens whose KV blocks an earlier prompt had filled "
            "(counted by the server over whole blocks; the engine does not report its own hits)",
            registry=r,
        )

        # vLLM's cache_config_info, the one an inference gateway's endpoint picker reads for the KV
        # block size its prefix-cache scorer hashes prompts by (set once a continuous batcher starts).
        self.cache_info = Gauge(
            "serve_cache_config_info",
            "Causal LMs, continuous batching: the KV cache's layout as labels (value 1)",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        )

    def add_capacity_metrics(self, r) -> None:
        """Causal LMs on a paged KV cache: what it holds (set once, at startup), and prompt lookup's yield."""
        from prometheus_client import Counter, Gauge

        self.kv_blocks = Gauge("serve_kv_cache_blocks", "Causal LMs: KV-cache blocks the engine holds", registry=r)
        self.kv_block_tokens = Gauge("serve_kv_cache_block_tokens", "Causal LMs: tokens per KV-cache block", registry=r)
        self.kv_bytes = Gauge(
            "serve_kv_cache_bytes", "Causal LMs: KV-cache bytes, at the cache's precision", ["precision"], registry=r
        )
        self.kv_tokens_per_gb = Gauge(
            "serve_kv_cache_tokens_per_gb", "Causal LMs: tokens the KV cache holds per GiB", registry=r
        )
        self.kv_max_sequences = Gauge(
            "serve_kv_cache_max_sequences",
            "Causal LMs: concurrent sequences of the declared request shape (prompt + output tokens) "
            "that fit the KV cache",
            ["sequence_tokens"],
            registry=r,
        )
        self.spec_drafts = Counter(
            "serve_spec_decode_num_drafts", "Prompt lookup: decode steps of a sequence that proposed tokens", registry=r
        )
        self.spec_draft_tokens = Counter(
            "serve_spec_decode_num_draft_tokens",
            "Prompt lookup: tokens proposed, counted as the most a step proposes (the engine does not report fewer)",
            registry=r,
        )
        self.spec_accepted = Counter(
            "serve_spec_decode_num_accepted_tokens", "Prompt lookup: proposed tokens the model accepted", registry=r
        )
        self.spec_acceptance = Gauge(
            "serve_spec_decode_acceptance_rate",
            "Prompt lookup: accepted over proposed tokens since start (a lower bound: see num_draft_tokens)",
            registry=r,
        )
        self.spec_per_step = Gauge(
            "serve_spec_decode_tokens_per_step",
            "Prompt lookup: tokens a sequence's decode step produced on average since start (1 + accepted)",
            registry=r,
        )

    def observe_kv_capacity(self, capacity, precision: str) -> None:
        self.kv_blocks.set(capacity.blocks)
        self.kv_block_tokens.set(capacity.block_tokens)
        self.kv_bytes.labels(precision=precision or "unknown").set(capacity.cache_bytes)
        self.kv_tokens_per_gb.set(capacity.tokens_per_gb)
        self.kv_max_sequences.labels(sequence_tokens=str(capacity.sequence_tokens)).set(capacity.sequences)

    def observe_speculation(self, accepted: int, proposed: int, steps: int, accepted_total: int) -> None:
        """One speculative step's figures, and the totals since start (steps, accepted tokens)."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(proposed)
        self.spec_accepted.inc(accepted)
        self.spec_acceptance.set(accepted_total / (steps * proposed))
        self.spec_per_step.set(1 + accepted_total / steps)

    def set_cache_info(self, block_tokens: int, num_blocks: int) -> None:
        self.cache_info.labels(str(block_tokens), str(num_blocks)).set(1)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
