"""Causal-LM endpoints on a genuinely tiny Llama built with onnxruntime-genai's builder:
completions and chat, whole and streamed (server-sent events), limits, and the encoder-only
endpoints refusing it. Random weights: the text is gibberish, the protocol is not."""

from __future__ import annotations

import json

import pytest

from tests.support.serve import metric_value

NAME = "tiny_llm"


def complete(client, **body):
    return client.post("/v1/completions", json={"model": NAME, "temperature": 0, **body})


def chat(client, **body):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Python?"}]
    return client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "temperature": 0, **body})


def sse_events(response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completion_whole(llm):
    response = complete(llm, prompt="The capital of Italy is", max_tokens=8)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == NAME
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_greedy_is_deterministic_and_streaming_gives_the_same_text(llm):
    whole = complete(llm, prompt="def main():", max_tokens=12).json()
    again = complete(llm, prompt="def main():", max_tokens=12).json()
    assert whole["choices"][0]["text"] == again["choices"][0]["text"]
    events = sse_events(
        complete(llm, prompt="def main():", max_tokens=12, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == whole["choices"][0]["text"]
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals == [whole["choices"][0]["finish_reason"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_chat_whole_and_streamed(llm):
    body = chat(llm, max_tokens=10).json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    events = sse_events(chat(llm, max_tokens=10, stream=True))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == message["content"]
    assert events[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_max_tokens_bounds_the_output(llm):
    body = complete(llm, prompt="Once upon a time", max_tokens=3).json()
    assert body["usage"]["completion_tokens"] <= 3
    if body["usage"]["completion_tokens"] == 3:
        assert body["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_output(llm):
    free = complete(llm, prompt="Once upon a time", max_tokens=20).json()["choices"][0]["text"]
    if len(free) < 4:
        pytest.skip("the random model ended too early to pick a stop string")
    stop = free[2:4]
    cut = complete(llm, prompt="Once upon a time", max_tokens=20, stop=[stop]).json()["choices"][0]
    assert cut["text"] == free[: free.find(stop)] and cut["finish_reason"] == "stop"


def test_token_id_prompts(llm):
    assert complete(llm, prompt=[5, 6, 7], max_tokens=2).status_code == 200
    assert complete(llm, prompt=[5, 10**6], max_tokens=2).status_code == 400


def test_limits_answer_400_with_a_reason(llm):
    over_cap = complete(llm, prompt="hi", max_tokens=65)  # the fixture caps max_tokens at 64
    assert over_cap.status_code == 400 and "max_tokens" in over_cap.json()["error"]["message"]
    too_long = complete(llm, prompt="word " * 400, max_tokens=2)  # context 256 tokens
    assert too_long.status_code == 400 and "prompt" in too_long.json()["error"]["message"]
    for bad in (
        {"n": 17},
        {"temperature": 3},
        {"top_p": -1},
        {"stop": ["a"] * 5},
        {"max_tokens": 0},
        {"logprobs": 21},
        {"echo": True},
        {"stream": "yes"},
    ):
        assert complete(llm, prompt="hi", **bad).status_code == 400, bad
    assert chat(llm, messages=[]).status_code == 400
    assert chat(llm, messages=[{"role": "wizard", "content": "x"}]).status_code == 400
    assert chat(llm, messages=[{"role": "user", "content": [{"type": "image_url"}]}]).status_code == 400


def test_unknown_model_is_404_and_encoder_endpoints_refuse(llm):
    missing = llm.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    embeddings = llm.post("/v1/embeddings", json={"model": NAME, "input": "x"})
    assert embeddings.status_code == 400 and "causal LM" in embeddings.json()["error"]["message"]
    infer = llm.post(f"/v2/models/{NAME}/infer", json={"inputs": []})
    assert infer.status_code == 400 and "/v1/completions" in infer.json()["error"]
    assert llm.get(f"/v2/models/{NAME}").json()["platform"] == "onnxruntime_genai"
    assert llm.get("/v1/models").json()["data"][0]["id"] == NAME


def test_sampling_with_a_seed_is_reproducible(llm):
    first = complete(llm, prompt="Hello", max_tokens=8, temperature=0.9, top_p=0.9, seed=7).json()
    second = complete(llm, prompt="Hello", max_tokens=8, temperature=0.9, top_p=0.9, seed=7).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_llm_metrics(llm):
    complete(llm, prompt="Hello", max_tokens=4)
    text = llm.get("/metrics").text
    assert metric_value(text, "serve_time_to_first_token_seconds_count") >= 1
    assert metric_value(text, "serve_generation_tokens_per_second_count") >= 1
    assert metric_value(text, "serve_generated_tokens_total") >= 1
    assert metric_value(text, "serve_requests_total", endpoint="/v1/completions", status="200") >= 1


def test_official_openai_client_streams(tiny_llm_artifact):
    """The official client against a real subprocess on loopback: whole, streamed, chat."""
    import openai

    from tests.support.serve import running_server

    with running_server(tiny_llm_artifact, "--max-tokens", "32") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0)
        pieces = [
            c.choices[0].text
            for c in client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0, stream=True)
            if c.choices
        ]
        assert "".join(pieces) == whole.choices[0].text
        reply = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        deltas = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
            )
        ]
        assert "".join(deltas) == reply.choices[0].message.content
        assert [m.id for m in client.models.list()] == [NAME]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt="Hello", max_tokens=1000)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
