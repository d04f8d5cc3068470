"""The KV cache's capacity and prompt lookup through a real server on loopback (the tiny OpenVINO GenAI
Llama, continuous batching): the capacity line at startup and in /metrics, and with --prompt-lookup
the same greedy text as without it, with its accepted tokens per step counted."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.serve.test_serve_llm_batching import body, concurrently, logged, metrics
from tests.support.serve import metric_value, running_server

pytestmark = pytest.mark.slow  # serves a model, twice
# Prompts whose continuation they contain (what prompt lookup speeds up), and one that does not.
PROMPTS = [
    "the cat sat on the mat and the dog lay on the rug. " * 3,
    "def main():\n    return 1\n" * 3,
    "A class definition",
]


def test_prompt_lookup_serves_the_plain_text_and_counts_what_it_accepted(tiny_ov_llm_artifact):
    # 1 GiB of f32 cache at 16 KiB a block: 65,536 blocks; a 1,024-token sequence takes 33 of them.
    with running_server(tiny_ov_llm_artifact, "--max-tokens", "32") as server:
        assert logged(server, "KV cache 65536 blocks of 32 tokens")
        assert logged(server, "1985 concurrent sequences of 1024 tokens") and logged(server, "prompt lookup off")
        text = metrics(server)
        assert metric_value(text, "serve_kv_cache_blocks") == 65536
        assert metric_value(text, "serve_kv_cache_max_sequences", sequence_tokens="1024") == 1985
        assert metric_value(text, "serve_kv_cache_bytes", precision="f32") == 2**30
        plain = [httpx.post(server.url + "/v1/completions", json=body(p, 24), timeout=60).json() for p in PROMPTS]
    with running_server(tiny_ov_llm_artifact, "--max-tokens", "32", "--prompt-lookup") as server:
        assert logged(server, "prompt lookup 5 tokens per step, n-grams up to 3")
        results = asyncio.run(concurrently(server.url, PROMPTS, 24))
        assert [text for _, text, _ in results] == [p["choices"][0]["text"] for p in plain]
        text = metrics(server)
        steps = metric_value(text, "serve_spec_decode_num_drafts_total")
        accepted = metric_value(text, "serve_spec_decode_num_accepted_tokens_total")
        assert steps > 0 and accepted > 0
        assert metric_value(text, "serve_spec_decode_num_draft_tokens_total") == 5 * steps
        assert metric_value(text, "serve_spec_decode_tokens_per_step") == pytest.approx(1 + accepted / steps)
        assert metric_value(text, "serve_spec_decode_acceptance_rate") == pytest.approx(accepted / (5 * steps))


def test_capacity_is_counted_for_the_declared_request_shape():
    from serve.llm.batching import DEFAULT_SEQUENCE_TOKENS, declared_sequence_tokens

    workload = {"declared": True, "requests": [{"prompt": 64, "output": 64}, {"prompt": 1024, "output": 128}]}
    assert declared_sequence_tokens({"metrics": {"workload": workload}}) == 1152
    # the one-point default a recipe gets without declaring one is not a declared shape
    assert declared_sequence_tokens({"metrics": {"workload": {**workload, "declared": False}}}) == 1024
    assert declared_sequence_tokens({}) == DEFAULT_SEQUENCE_TOKENS == 1024
