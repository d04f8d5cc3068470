"""Batching through ONNX Runtime GenAI's own Engine on the tiny Llama: a real server on loopback, real
httpx and openai clients. On a CPU model the Engine batches statically (up to 4 sequences started
together, the next batch when that one ends): streams of one batch interleave and give the text one
generation at a time gives, a request that arrives during a batch waits for it, a KV cache too small
for a whole batch makes requests wait (then 429 past the queue), a prompt that can never fit is a 400,
and a client that leaves mid-stream is gone from /metrics at once. Token delays make streams slow
enough to overlap; nothing here asserts a time."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.serve import metric_value, running_server, wait_until

NAME = "tiny_llm"
PROMPTS = ["def main():", "The return statement", "A class definition", "import sys"]
STATIC = "static batching in ONNX Runtime GenAI's Engine"


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def kv_gb(tokens: int) -> str:
    """--kv-cache-gb for a cache of this many tokens of the tiny Llama (2 layers x key and value x 2
    KV heads x 16 x f32 = 512 bytes a token)."""
    return str(tokens * 512 / 2**30)


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


def logged(server, text: str) -> bool:
    return bool(wait_until(lambda: text in server.output, timeout=10))


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def completion(server, prompt: str, max_tokens: int) -> str:
    r = httpx.post(server.url + "/v1/completions", json=body(prompt, max_tokens), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def seeded(server, prompt: str) -> str:
    payload = body(prompt, 12, temperature=0.9, seed=7)
    r = httpx.post(server.url + "/v1/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def one_at_a_time_texts(tiny_llm_artifact) -> list[str]:
    """Each prompt's greedy text, then one seeded sample, from the server one generation at a time
    (the Generator path)."""
    with running_server(tiny_llm_artifact, "--max-num-seqs", "1", "--max-tokens", "64") as server:
        assert logged(server, "one generation at a time (--max-num-seqs 1)")
        return [completion(server, p, 12) for p in PROMPTS] + [seeded(server, PROMPTS[0])]


@pytest.fixture(scope="module")
def server(tiny_llm_artifact):
    """One batching server, tokens 20 ms apart, for the tests that need no other flag: each waits for
    it to be idle and reads what its own requests changed in /metrics, never its totals."""
    with running_server(tiny_llm_artifact, "--max-tokens", "64", token_delay_s=0.02) as server:
        yield server


def idle(server) -> str:
    """/metrics once no request is running (the previous test's streams may still be ending)."""

    def metrics_when_idle() -> str | None:
        text = metrics(server)
        return text if metric_value(text, "serve_num_requests_running") == 0 else None

    return wait_until(metrics_when_idle, timeout=30)


def test_a_batch_streams_together_and_matches_one_at_a_time(server, one_at_a_time_texts):
    assert logged(server, STATIC)
    assert logged(server, "--max-num-seqs 16 asked: its static batches hold 4")
    before = idle(server)

    async def batch():
        return await asyncio.gather(*(stream_times(server.url, p, 12) for p in PROMPTS))

    results = asyncio.run(batch())
    assert [status for status, _, _ in results] == [200] * len(PROMPTS)
    assert [text for _, text, _ in results] == one_at_a_time_texts[: len(PROMPTS)]
    # every stream had begun before any ended: they ran together, not one after another
    assert max(stamps[0] for _, _, stamps in results) < min(stamps[-1] for _, _, stamps in results)
    text = metrics(server)
    assert metric_value(text, "serve_num_requests_running") == 0

    def counted(name: str) -> float:
        return metric_value(text, name) - metric_value(before, name)

    assert counted("serve_time_to_first_token_seconds_count") == len(PROMPTS)
    assert counted("serve_request_queue_time_seconds_count") == len(PROMPTS)
    assert counted("serve_generation_tokens_total") == counted("serve_generated_tokens_total")
    assert metric_value(text, "serve_prefix_cache_queries_total") == 0  # the Engine has no prefix cache here
    # a seeded sample runs alone (the static Engine takes no seed per request): the same text as one at a time
    assert seeded(server, PROMPTS[0]) == one_at_a_time_texts[-1]


def test_requests_still_being_read_join_the_batch_after_a_lone_request(server):
    """After one request alone (a warm-up) the next batch would wait for one request only. Requests
    whose bodies are still arriving when it forms are waited for too (up to the engine's gather
    time): three clients whose bodies come 20 ms late share a batch with a fourth that is complete at
    once, rather than waiting a whole generation behind a batch of one."""
    idle(server)
    completion(server, PROMPTS[0], 4)

    async def late_body(prompt: str):
        await asyncio.sleep(0.02)
        yield json.dumps(body(prompt, 12, stream=True)).encode()

    async def stream(prompt: str, late: bool) -> list[float]:
        stamps = []
        content = late_body(prompt) if late else json.dumps(body(prompt, 12, stream=True)).encode()
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", server.url + "/v1/completions", content=content, headers=headers) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and not json.loads(line[6:])["choices"][0]["finish_reason"]:
                        stamps.append(time.monotonic())
        return stamps

    async def scenario():
        late = [asyncio.create_task(stream(p, late=True)) for p in PROMPTS[1:]]
        await asyncio.sleep(0.005)  # their headers are in: the server is reading their bodies
        return await asyncio.gather(stream(PROMPTS[0], late=False), *late)

    results = asyncio.run(scenario())
    assert max(stamps[0] for stamps in results) < min(stamps[-1] for stamps in results)


def test_a_request_that_arrives_during_a_batch_waits_for_it(server):
    """What static batching costs: a fifth stream starts only once the batch of four has ended."""
    idle(server)

    async def scenario():
        first = [asyncio.create_task(stream_times(server.url, p, 16)) for p in PROMPTS]
        await asyncio.to_thread(
            wait_until, lambda: metric_value(metrics(server), "serve_num_requests_running") == 4, 30
        )
        late = await stream_times(server.url, "x = 1", 4)
        return await asyncio.gather(*first), late

    batch, (status, _, late_stamps) = asyncio.run(scenario())
    assert status == 200 and [s for s, _, _ in batch] == [200] * 4
    assert late_stamps[0] > max(stamps[-1] for _, _, stamps in batch)


def test_usage_in_the_last_chunk_with_the_openai_client(tiny_llm_artifact):
    import openai

    with running_server(tiny_llm_artifact, "--max-tokens", "16") as server:
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
        messages = [{"role": "user", "content": "What is Python?"}]
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content


def test_a_small_kv_cache_makes_requests_wait_then_429(tiny_llm_artifact):
    """A cache of 100 tokens; each request holds up to about 45 (prompt + 40 new), and a static batch
    takes its size x its longest: of three requests at most two run and the rest wait; with the queue
    (--max-queue 2) full, the next request is refused with 429; every admitted request finishes.
    (Whether the first batch holds one or two depends on how far apart the requests arrive.)"""
    args = ("--kv-cache-gb", kv_gb(100), "--max-queue", "2", "--max-tokens", "64")
    with running_server(tiny_llm_artifact, *args, token_delay_s=0.1) as server:  # a batch lasts 4 s
        assert logged(server, "(100 tokens;")

        def post_one_more() -> httpx.Response:
            return httpx.post(server.url + "/v1/completions", json=body("one more", 40), timeout=60)

        async def scenario():
            streams = [asyncio.create_task(stream_times(server.url, p, 40)) for p in PROMPTS[:3]]
            await asyncio.to_thread(
                wait_until, lambda: metric_value(metrics(server), "serve_num_requests_waiting") >= 1, 30
            )
            snapshot = metrics(server)
            extras, refused = [], None
            for _ in range(2):  # a refusal is immediate; an admitted request answers when it has run
                extras.append(asyncio.create_task(asyncio.to_thread(post_one_more)))
                done, _ = await asyncio.wait({extras[-1]}, timeout=1)
                if done:
                    refused = extras.pop().result()
                    break
            return snapshot, refused, await asyncio.gather(*streams), await asyncio.gather(*extras)

        snapshot, refused, results, admitted = asyncio.run(scenario())
        assert 1 <= metric_value(snapshot, "serve_num_requests_running") <= 2
        assert metric_value(snapshot, "serve_kv_cache_usage_perc") > 0
        assert refused is not None and refused.status_code == 429, refused and refused.text
        assert [status for status, _, _ in results] == [200] * 3
        assert all(len(stamps) > 0 for _, _, stamps in results)
        assert all(r.status_code == 200 for r in admitted)


def test_a_prompt_that_cannot_fit_the_cache_is_a_400(tiny_llm_artifact):
    import openai

    with running_server(tiny_llm_artifact, "--kv-cache-gb", kv_gb(100), "--max-tokens", "200") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="tokens of KV cache") as caught:
            client.completions.create(model=NAME, prompt="def main():", max_tokens=150)
        assert "holds 100" in str(caught.value)
        # without max_tokens the request gets what the cache can hold
        whole = client.completions.create(model=NAME, prompt="def main():", temperature=0)
        assert 0 < whole.usage.prompt_tokens + whole.usage.completion_tokens < 100


def test_a_client_that_leaves_mid_stream_is_gone_at_once(tiny_llm_artifact):
    with running_server(tiny_llm_artifact, "--max-tokens", "200", token_delay_s=0.05) as server:
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
        # the engine took its batch back: the next request runs
        assert completion(server, "import sys", 4)
