"""logprobs, n, the sampling extensions, the refused fields and /tokenize, through the official
`openai` client against a real `python -m serve` on loopback, on the tiny test LMs of both engines
(ONNX Runtime GenAI in static batches, OpenVINO GenAI in continuous batching). Random weights: the
text is gibberish; the shapes, counts and refusals are what is checked."""

from __future__ import annotations

import math

import httpx
import pytest

from serve.llm.fields import FIELDS
from tests.support.serve import running_server

pytestmark = pytest.mark.slow  # the artifacts are built by the session fixtures
NAME = "tiny_llm"
MESSAGES = [{"role": "user", "content": "hi"}]
# A value that asks for something, for each refused field.
ASKING = {
    "store": True,
    "service_tier": "flex",
    "modalities": ["text", "audio"],
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "logit_bias": {"1": 5},
    "audio": {"voice": "alloy", "format": "mp3"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {},
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {},
    "best_of": 2,
    "echo": True,
    "suffix": "x",
}


@pytest.fixture(scope="module", params=["ort", "ov"])
def served(request):
    """(openai client, raw base URL, engine name) for each engine's tiny artifact."""
    import openai

    artifact = request.getfixturevalue("tiny_llm_artifact" if request.param == "ort" else "tiny_ov_llm_artifact")
    with running_server(artifact, "--max-tokens", "16") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield client, server.url, "onnxruntime-genai" if request.param == "ort" else "openvino-genai"


def test_chat_logprobs_one_entry_per_token_and_a_greedy_token_is_its_best(served):
    import openai

    client, _, engine = served
    if engine == "openvino-genai":  # its pipeline gives the chosen token's logprob, no alternatives
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3)
        assert refused.value.body["param"] == "top_logprobs" and "at most 0" in refused.value.body["message"]
    top = 3 if engine == "onnxruntime-genai" else 0
    reply = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=top
    )
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens > 0
    for entry in entries:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == top
        if top:
            assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
    streamed = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=top, stream=True
    )
    chunks = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in chunks] == pytest.approx([e.logprob for e in entries])


def test_completion_logprobs_in_the_legacy_shape(served):
    client, _, engine = served
    k = 2 if engine == "onnxruntime-genai" else 0
    reply = client.completions.create(model=NAME, prompt="Hello", max_tokens=5, temperature=0, logprobs=k)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens
    assert logprobs.text_offset[0] == 0 and all(len(top) == k for top in logprobs.top_logprobs)


def test_n_gives_independent_choices_whole_and_streamed(served):
    client, _, _ = served
    reply = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=1.0, seed=5, n=2)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    again = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=1.0, seed=5, n=2)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]  # choice i: seed + i
    unseeded = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=1.0, n=2)
    assert unseeded.choices[0].text != unseeded.choices[1].text  # sampled independently, not one fixed seed
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=4, temperature=0, n=2, stream=True
    )
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_sampling_extensions_are_honoured_or_refused_by_name(served):
    import openai

    client, _, engine = served
    asked = {"top_k": 5, "repetition_penalty": 1.3, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    refused = set() if engine == "openvino-genai" else {"min_p", "presence_penalty", "frequency_penalty"}
    for name, value in asked.items():
        body = dict(model=NAME, prompt="Hello", max_tokens=3, temperature=1.0, extra_body={name: value})
        if name in refused:
            with pytest.raises(openai.BadRequestError) as refusal:
                client.completions.create(**body)
            assert refusal.value.body["param"] == name and engine in refusal.value.body["message"]
        else:
            assert client.completions.create(**body).usage.completion_tokens >= 1


def test_every_refused_and_unknown_field_is_a_400_naming_it(served):
    _, url, _ = served
    base = {"model": NAME, "max_tokens": 2}
    assert {f.name for f in FIELDS if f.handling == "refused"} == set(ASKING)
    for field in FIELDS:
        if field.handling != "refused":
            continue
        for route in field.routes:
            body = {**base, **({"messages": MESSAGES} if route == "chat" else {"prompt": "Hi"})}
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            answer = httpx.post(url + path, json={**body, field.name: ASKING[field.name]}, timeout=30)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field.name, (
                field.name,
                answer.text,
            )
    answer = httpx.post(url + "/v1/completions", json={**base, "prompt": "Hi", "best_of_luck": 1}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "best_of_luck"
    harmless = {**base, "prompt": "Hi", "user": "u", "echo": False, "best_of": 1, "logit_bias": None}
    assert httpx.post(url + "/v1/completions", json=harmless, timeout=30).status_code == 200


def test_tokenize_round_trips_and_models_lists_the_model(served):
    client, url, _ = served
    tokens = httpx.post(url + "/tokenize", json={"content": "Hello world"}, timeout=30).json()["tokens"]
    assert (
        tokens and httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()["tokens"] == tokens
    )
    text = httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["content"]
    assert text == "Hello world"
    bad = httpx.post(url + "/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    reply = client.completions.create(model=NAME, prompt=tokens, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == len(tokens)
    assert [m.id for m in client.models.list()] == [NAME]


def test_onnxruntime_genai_logprobs_are_of_the_position_each_token_was_chosen_at(tiny_llm_artifact):
    """Each generated token's logprob and alternatives come from the logits it was chosen from: a
    greedy token is its position's best, and its logprob is the teacher-forced one of the same text
    (read one step late, they were the next position's)."""
    import numpy as np

    from engines.generation import Sampling
    from engines.onnxruntime_genai.runner import GenAIRunner

    runner = GenAIRunner(tiny_llm_artifact / "genai", threads=1)
    prompt = runner.encode("hello world")
    entries: list = []
    sampling = Sampling(6, temperature=0.0, logprobs=True, top_logprobs=2)
    tokens = [token for token, _ in runner.generate(prompt, sampling, on_logprob=entries.append)]
    assert [e.token for e in entries] == tokens and tokens
    assert [e.top[0][0] for e in entries] == tokens
    forced = runner.log_likelihood(prompt + tokens, start=len(prompt))
    np.testing.assert_allclose([e.logprob for e in entries], forced, atol=1e-3)
