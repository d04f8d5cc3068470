"""A new generating engine is one module implementing engines/generation.py's Generator, plus its row
in the format table: a module written to a temporary directory (on sys.path, as if dropped into
engines/) and a row added to engines.formats.FORMATS (as a new runtime's would be) are served through
/v1/completions, whole and streamed, with nothing in serve/ or engines/ edited."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engines import formats
from tests.support.serve import in_process
from tests.support.tiny_llm import write_manifest

MODULE = "tmp_counting_engine"
FORMAT = "tmp-counting"

ENGINE_FILE = '''\
"""Counts through a five-word vocabulary: after word k comes word k+1, and after the last one, EOS."""

import json
from pathlib import Path

from engines.generation import Generator, Sampling, refuse_unhonoured

EOS = 0


class CountingGenerator:
    def __init__(self, folder: Path):
        self.words = json.loads((folder / "vocab.json").read_text())
        self.context_length = 64
        self.vocab_size = len(self.words)

    def encode(self, text):
        return [self.words.index(word) for word in text.split()]

    def decode(self, ids):
        return "".join(" " + self.words[i] for i in ids)

    def chat_prompt(self, messages, tools=None):
        return " ".join(m["content"] for m in messages)

    def generate(self, prompt_ids, sampling: Sampling, cancelled=lambda: False):
        refuse_unhonoured(sampling, "tmp-counting")
        token = prompt_ids[-1]
        for _ in range(sampling.max_new_tokens):
            if cancelled():
                return
            token = token + 1 if token + 1 < self.vocab_size else EOS
            if token == EOS:
                return
            yield token, self.decode([token])


def load(root, engine, threads=0, spinning=True) -> Generator:
    return CountingGenerator(Path(root) / engine["dir"])
'''


@pytest.fixture()
def counting_artifact(tmp_path, monkeypatch) -> Path:
    """The engine module on sys.path, its row in the table, and an artifact whose manifest names it."""
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{MODULE}.py").write_text(ENGINE_FILE)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setitem(formats.FORMATS, FORMAT, formats.EngineFormat(FORMAT, f"{MODULE}:load", (), "causal_lm"))
    artifact = tmp_path / "artifact"
    (artifact / "model").mkdir(parents=True)
    (artifact / "model" / "vocab.json").write_text(json.dumps(["<eos>", "one", "two", "three", "four", "five"]))
    write_manifest(artifact, {"format": FORMAT, "dir": "model", "task": "causal_lm"})
    yield artifact
    sys.modules.pop(MODULE, None)


def sse_data(response) -> list:
    lines = [line for line in response.text.split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_new_engine_module_is_served_through_completions(counting_artifact):
    body = {"model": "tiny_llm", "prompt": "one two", "temperature": 0}
    with in_process(counting_artifact, max_tokens=16) as client:
        assert client.get("/v2/health/ready").status_code == 200
        whole = client.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        choice = whole.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (" three four five", "stop")
        assert whole.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}

        cut = client.post("/v1/completions", json={**body, "max_tokens": 2}).json()["choices"][0]
        assert (cut["text"], cut["finish_reason"]) == (" three four", "length")

        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        chunks = sse_data(streamed)
        assert [c["choices"][0]["text"] for c in chunks] == [" three", " four", " five", ""]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert MODULE in sys.modules  # served by the module written above, through its row
