"""Continuous batching on a tiny OpenVINO GenAI Llama: a real server on loopback driving the engine's
own scheduler, with real httpx and openai clients. Streams that run together, a KV cache too small for
everyone (requests wait, then 429 past the queue), a prompt that can never fit (400), a client that
leaves mid-stream (its sequence gone from /metrics), prefix-cache hits counted, and one generation at a
time still available (--max-num-seqs 1). Token delays make streams slow enough to overlap; nothing
here asserts a time."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.serve import metric_value, running_server, wait_until

NAME = "tiny_llm"
# The tiny Llama's KV cache takes 512 bytes a token (2 layers x key and value x 2 heads x 16 x f32):
# a block of 32 tokens is 16 KiB, so this setting is a cache of 4 blocks.
FOUR_BLOCKS_GB = str(4 * 16 * 1024 / 2**30)
PROMPTS = ["def main():", "The return statement", "A class definition", "import sys"]


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


async def stream_times(url: str, prompt: str, max_tokens: int) -> tuple[int, str, list[float]]:
    """One streamed completion: status, its text, and when each text chunk arrived."""
    text, stamps = "", []
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url + "/v1/completions", json=body(prompt, max_tokens, stream=True)) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode(), []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and not chunk["choices"][0]["finish_reason"]:
                        text += chunk["choices"][0]["text"]
                        stamps.append(time.monotonic())
    return 200, text, stamps


async def concurrently(url: str, prompts: list[str], max_tokens: int):
    return await asyncio.gather(*(stream_times(url, p, max_tokens) for p in prompts))


def logged(server, text: str) -> bool:
    """Whether the server wrote this (its output is read by another thread: wait for it)."""
    return bool(wait_until(lambda: text in server.output, timeout=10))


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


@pytest.fixture(scope="module")
def server(tiny_ov_llm_artifact):
    """One server with the default batching for the tests that need no other flag; they read what their
    own requests changed in /metrics, never its totals."""
    with running_server(tiny_ov_llm_artifact, "--max-tokens", "16") as server:
        yield server


def test_concurrent_streams_interleave_and_match_their_solo_text(tiny_ov_llm_artifact):
    with running_server(tiny_ov_llm_artifact, "--max-tokens", "64", token_delay_s=0.02) as server:
        assert logged(server, "continuous batching in OpenVINO GenAI's scheduler")
        alone = [httpx.post(server.url + "/v1/completions", json=body(p, 12), timeout=60).json() for p in PROMPTS]
        results = asyncio.run(concurrently(server.url, PROMPTS, 12))
        assert [status for status, _, _ in results] == [200] * len(PROMPTS)
        # greedy decoding gives each prompt the same text batched as alone
        assert [text for _, text, _ in results] == [a["choices"][0]["text"] for a in alone]
        # every stream had begun before any ended: they ran together, not one after another
        assert max(stamps[0] for _, _, stamps in results) < min(stamps[-1] for _, _, stamps in results)
        text = metrics(server)
        assert metric_value(text, "serve_time_to_first_token_seconds_count") == 2 * len(PROMPTS)
        assert metric_value(text, "serve_inter_token_latency_seconds_count") > 0
        assert metric_value(text, "serve_e2e_request_latency_seconds_count") == 2 * len(PROMPTS)
        assert metric_value(text, "serve_request_queue_time_seconds_count") == 2 * len(PROMPTS)
        assert metric_value(text, "serve_generation_tokens_total") == metric_value(text, "serve_generated_tokens_total")


def test_usage_in_the_last_chunk_with_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="def main():",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens > 0


def test_a_full_kv_cache_makes_requests_wait_then_429(tiny_ov_llm_artifact):
    """4 blocks; each request holds 2 at its longest (about 10 prompt + 40 new tokens): two run, two
    wait in the queue (--max-queue 2), a fifth is refused with 429, and all four admitted finish."""
    args = ("--kv-cache-gb", FOUR_BLOCKS_GB, "--max-queue", "2", "--max-tokens", "64", "--no-prefix-caching")
    with running_server(tiny_ov_llm_artifact, *args, token_delay_s=0.05) as server:
        assert logged(server, "(4 blocks of 32 tokens)")

        async def scenario():
            streams = [asyncio.create_task(stream_times(server.url, p, 40)) for p in PROMPTS]
            await asyncio.to_thread(
                wait_until, lambda: metric_value(metrics(server), "serve_num_requests_waiting") == 2, 30
            )
            extra = await asyncio.to_thread(
                httpx.post, server.url + "/v1/completions", json=body("one more", 40), timeout=30
            )
            snapshot = metrics(server)
            return snapshot, extra, await asyncio.gather(*streams)

        snapshot, extra, results = asyncio.run(scenario())
        assert metric_value(snapshot, "serve_num_requests_running") == 2
        assert metric_value(snapshot, "serve_kv_cache_usage_perc") > 0
        assert extra.status_code == 429, extra.text
        assert [status for status, _, _ in results] == [200] * 4
        assert all(len(stamps) > 0 for _, _, stamps in results)


def test_a_prompt_that_cannot_fit_the_cache_is_a_400(tiny_ov_llm_artifact):
    import openai

    with running_server(tiny_ov_llm_artifact, "--kv-cache-gb", FOUR_BLOCKS_GB, "--max-tokens", "200") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="KV-cache blocks") as caught:
            client.completions.create(model=NAME, prompt="def main():", max_tokens=150)
        assert "holds 4" in str(caught.value)
        # without max_tokens the request gets what the cache can hold
        whole = client.completions.create(model=NAME, prompt="def main():", temperature=0)
        assert 0 < whole.usage.prompt_tokens + whole.usage.completion_tokens < 4 * 32


def test_a_client_that_leaves_mid_stream_frees_its_sequence(tiny_ov_llm_artifact):
    # without prefix caching a freed block is empty at once (with it, the prompt's blocks stay cached)
    args = ("--max-tokens", "200", "--kv-cache-gb", str(16 * 16 * 1024 / 2**30), "--no-prefix-caching")
    with running_server(tiny_ov_llm_artifact, *args, token_delay_s=0.05) as server:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", server.url + "/v1/completions", json=body("def main():", 200, stream=True)) as r:
                lines = r.iter_lines()
                assert any(line.startswith("data: {") and '"text":""' not in line for line in lines)
                during = metrics(server)
        assert metric_value(during, "serve_num_requests_running") == 1
        assert metric_value(during, "serve_kv_cache_usage_perc") > 0
        wait_until(lambda: metric_value(metrics(server), "serve_num_requests_running") == 0, timeout=10)
        after = metrics(server)
        assert metric_value(after, "serve_kv_cache_usage_perc") == 0
        generated = metric_value(after, "serve_generation_tokens_total")
        time.sleep(0.5)
        assert metric_value(metrics(server), "serve_generation_tokens_total") == generated < 200  # no more decoding
        wait_until(lambda: metric_value(metrics(server), "serve_requests_total", status="499") == 1, timeout=10)


def test_prefix_cache_hits_are_counted(server, tiny_ov_llm_artifact):
    shared = "The return statement leaves the current function call with the expression list. " * 2
    before = metrics(server)
    for question in ("What is it?", "Why?"):
        r = httpx.post(server.url + "/v1/completions", json=body(shared + question, 4), timeout=30)
        assert r.status_code == 200, r.text
    after = metrics(server)

    def counted(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    queries, hits = counted("serve_prefix_cache_queries_total"), counted("serve_prefix_cache_hits_total")
    assert queries >= 2 * 32 and hits >= 32  # the second prompt found the first's whole blocks
    assert hits < queries
    with running_server(tiny_ov_llm_artifact, "--max-tokens", "16", "--no-prefix-caching") as uncached:
        assert logged(uncached, "prefix caching off")
        httpx.post(uncached.url + "/v1/completions", json=body(shared, 4), timeout=30)
        assert metric_value(metrics(uncached), "serve_prefix_cache_queries_total") == 0


def test_one_at_a_time_on_request(tiny_ov_llm_artifact):
    with running_server(tiny_ov_llm_artifact, "--max-num-seqs", "1", "--max-tokens", "16") as server:
        assert logged(server, "one generation at a time (--max-num-seqs 1)")
        r = httpx.post(server.url + "/v1/completions", json=body("def main():", 8), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8
        assert metric_value(metrics(server), "serve_num_requests_running") == 0


def test_chat_and_seeded_sampling_in_the_batch(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is Python?"}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    deltas = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in deltas if c.choices)
    assert streamed == reply.choices[0].message.content
    seeded = [
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0.8, seed=3)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
