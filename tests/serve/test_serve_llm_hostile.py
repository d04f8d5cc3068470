"""Hostile sampling values and conversations against real servers on loopback (`python -m serve`
on the tiny test LMs of both engines: ONNX Runtime GenAI in static batches, OpenVINO GenAI in
continuous batching): top_p 0 and vanishing temperatures, logprobs 0 and top_logprobs without
logprobs, a conversation the model's own chat template refuses, a fuzz of every sampling field
(only "2xx or 4xx" is asserted), and prompts too long to tokenize refused before any tokenizer
sees them, off the event loop."""

from __future__ import annotations

import html
import json
import re
import shutil
import threading

import httpx
import pytest

from tests.support.serve import in_process, running_server

pytestmark = pytest.mark.slow  # the artifacts are built by the session fixtures
NAME = "tiny_llm"
MESSAGES = [{"role": "user", "content": "hi"}]
# A Mistral-style template: it raises unless user and assistant turns alternate, starting with user.
ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
)


def artifact_of(request, engine: str):
    return request.getfixturevalue("tiny_llm_artifact" if engine == "ort" else "tiny_ov_llm_artifact")


@pytest.fixture(scope="module", params=["ort", "ov"])
def served(request):
    """(server, engine) for each engine's tiny artifact."""
    with running_server(artifact_of(request, request.param), "--max-tokens", "16") as server:
        yield server, request.param


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": NAME, **body}, timeout=60, **kwargs)


def streamed_text(server, path: str, body: dict) -> str:
    response = post(server, path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    assert '"server_error"' not in response.text, response.text
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0].get("text") or "" for c in chunks if c["choices"])


# --- top_p 0 and vanishing temperatures: greedy decoding, not a 500 ----------------------------------


@pytest.mark.parametrize(
    "asked",
    [{"top_p": 0}, {"top_p": 1e-300}, {"temperature": 1e-300}, {"temperature": 5e-324, "top_p": 0.5}],
    ids=["top_p=0", "top_p=1e-300", "temperature=1e-300", "temperature=5e-324"],
)
def test_top_p_0_and_a_vanishing_temperature_decode_greedily(served, asked):
    server, _ = served
    body = {"prompt": "The", "max_tokens": 6}
    greedy = post(server, "/v1/completions", {**body, "temperature": 0})
    assert greedy.status_code == 200, greedy.text
    answer = post(server, "/v1/completions", {**body, **asked})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert streamed_text(server, "/v1/completions", {**body, **asked}) == greedy.json()["choices"][0]["text"]
    # Several at once: the batching engines take them together.
    replies = post(server, "/v1/completions", {**body, **asked, "n": 3}).json()["choices"]
    assert [c["text"] for c in replies] == [greedy.json()["choices"][0]["text"]] * 3


# --- logprobs 0, and top_logprobs without logprobs -----------------------------------------------------


def test_completion_logprobs_0_is_the_chosen_tokens_alone(served):
    server, _ = served
    reply = post(server, "/v1/completions", {"prompt": "The", "max_tokens": 4, "logprobs": 0}).json()
    logprobs, usage = reply["choices"][0]["logprobs"], reply["usage"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == usage["completion_tokens"] == 4
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert logprobs["top_logprobs"] == [{}] * 4  # no alternatives asked


@pytest.mark.parametrize("logprobs", [None, False])
@pytest.mark.parametrize("top", [0, 2])
def test_top_logprobs_without_logprobs_is_a_400(served, logprobs, top):
    server, _ = served
    body: dict = {"messages": MESSAGES, "max_tokens": 2, "top_logprobs": top}
    if logprobs is not None:
        body["logprobs"] = logprobs
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "top_logprobs" and "logprobs" in error["message"]


# --- a conversation the model's chat template refuses ---------------------------------------------------


def with_template(artifact, out, template: str):
    """A copy of a tiny artifact whose tokenizer carries `template` (where each engine reads it:
    onnxruntime-genai's chat_template.jinja, the OpenVINO tokenizer IR's rt_info), resealed."""
    from engines.artifact import read_manifest
    from tests.support.tiny_llm import write_manifest

    shutil.copytree(artifact, out)
    (out / "manifest.json").unlink()
    engine = read_manifest(artifact)["engine"]
    folder = out / engine["dir"]
    if (folder / "openvino_tokenizer.xml").is_file():
        xml = folder / "openvino_tokenizer.xml"
        value = html.escape(template, quote=True)
        text, count = re.subn(
            r'<chat_template value="[^"]*"', lambda _: f'<chat_template value="{value}"', xml.read_text()
        )
        assert count == 1
        xml.write_text(text)
    (folder / "chat_template.jinja").write_text(template)
    write_manifest(out, engine)
    return out


@pytest.mark.parametrize("engine", ["ort", "ov"])
def test_a_conversation_the_models_template_refuses_is_a_400_with_its_words(request, tmp_path, engine):
    artifact = with_template(artifact_of(request, engine), tmp_path / "artifact", ALTERNATING)
    with running_server(artifact, "--max-tokens", "4") as server:
        ok = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        tokens = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
        assert tokens == post(server, "/tokenize", {"content": "[INST] hi [/INST]"}).json()["tokens"]
        twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        for path in ("/v1/chat/completions", "/tokenize"):
            response = post(server, path, {"messages": twice, **({"max_tokens": 2} if "chat" in path else {})})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages", error
            assert "chat template refuses" in error["message"] and "roles must alternate" in error["message"]
            assert "\n" not in error["message"] and "row" not in error["message"]


# --- fuzz: every sampling field, any value -------------------------------------------------------------

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_p",
    "seed",
    "n",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def sampling_bodies():
    from hypothesis import strategies as st

    numbers = st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=-1e-300, max_value=1e-300),
        st.floats(min_value=0, max_value=2),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.integers(min_value=-2, max_value=20),
        st.sampled_from(["NaN", "nan", "inf", "-1", "0.5", "", True, False, None, [], {}, [0.5]]),
    )
    fields = st.dictionaries(st.sampled_from(SAMPLING_FIELDS), numbers, max_size=5)
    chat = st.fixed_dictionaries(
        {"messages": st.just(MESSAGES)},
        optional={"logprobs": st.one_of(st.booleans(), numbers), "top_logprobs": numbers},
    )
    completion = st.fixed_dictionaries({"prompt": st.just("The")}, optional={"logprobs": numbers})
    stream = st.fixed_dictionaries({}, optional={"stream": st.booleans()})
    return st.tuples(st.one_of(chat, completion), fields, stream).map(lambda t: {**t[0], **t[1], **t[2]})


def test_any_sampling_values_are_answered_2xx_or_4xx(served):
    from hypothesis import HealthCheck, given, settings

    server, _ = served
    client = httpx.Client(base_url=server.url, timeout=60)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(sampling_bodies())
    def check(body):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        payload = json.dumps({"model": NAME, **body}, allow_nan=True)  # NaN and Infinity as bare words
        response = client.post(path, content=payload, headers={"Content-Type": "application/json"})
        assert response.status_code < 500, (body, response.text)
        if response.status_code < 300:
            assert '"server_error"' not in response.text, (body, response.text)  # a stream that failed midway
        else:
            assert response.status_code >= 400 and "\n" not in response.json()["error"]["message"]

    try:
        check()
    finally:
        client.close()


# --- prompts too long to tokenize ---------------------------------------------------------------------


class CountedEncode:
    """The model's real encode, counted, with where each call ran (whether an event loop runs there)."""

    def __init__(self, encode):
        self.encode, self.calls, self.on_a_loop = encode, 0, []

    def __call__(self, text: str) -> list[int]:
        import asyncio

        self.calls += 1
        try:
            asyncio.get_running_loop()
            self.on_a_loop.append(True)
        except RuntimeError:
            self.on_a_loop.append(False)
        return self.encode(text)


def test_a_prompt_too_long_to_tokenize_is_refused_before_any_tokenizing(tiny_llm_artifact):
    with in_process(tiny_llm_artifact) as client:
        model = client.app.state.serve.model
        counted = model.runner.encode = CountedEncode(model.runner.encode)
        huge = "word " * 400_000  # 2 MB: inside the body limit, far past what 255 tokens can hold
        for path, body in (
            ("/v1/completions", {"prompt": huge}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
            ("/tokenize", {"content": huge}),
            ("/tokenize", {"messages": [{"role": "user", "content": huge}]}),
        ):
            response = client.post(path, json={"model": NAME, "max_tokens": 2, **body} if "v1" in path else body)
            assert response.status_code == 400, response.text
            assert "characters" in response.json()["error"]["message"]
        assert counted.calls == 0
        # What is tokenized is tokenized in a worker thread, not on the event loop.
        assert client.post("/v1/completions", json={"model": NAME, "prompt": "The", "max_tokens": 2}).status_code == 200
        assert client.post("/tokenize", json={"content": "The"}).status_code == 200
        assert counted.calls == 2 and counted.on_a_loop == [False, False]


def test_huge_prompts_are_refused_alongside_a_running_stream_and_health(tiny_llm_artifact):
    """Eight prompts near the body limit sent at once, a stream and the health route beside them:
    every prompt is a 400 for its length (not a 413, not a 500), the stream runs to its end."""
    huge = json.dumps({"model": NAME, "prompt": "x" * ((4 << 20) - 200), "max_tokens": 2}).encode()
    with running_server(tiny_llm_artifact) as server:
        refusals: list[httpx.Response] = []

        def refuse() -> None:
            headers = {"Content-Type": "application/json"}
            refusals.append(httpx.post(server.url + "/v1/completions", content=huge, headers=headers, timeout=120))

        threads = [threading.Thread(target=refuse) for _ in range(8)]
        for thread in threads:
            thread.start()
        text = streamed_text(server, "/v1/completions", {"prompt": "The", "max_tokens": 8})
        health = httpx.get(server.url + "/v2/health/live", timeout=60).status_code
        for thread in threads:
            thread.join()
        assert health == 200 and text
        assert [r.status_code for r in refusals] == [400] * 8, refusals[0].text
        assert all("characters" in r.json()["error"]["message"] for r in refusals)
