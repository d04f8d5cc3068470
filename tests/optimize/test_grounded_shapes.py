"""A workload's grounded request shape (`kind: grounded`): chat requests that ask for a given paragraph
back edited or summarised, rendered by the model's own chat template into the token ids the race and
the evaluation send, one paragraph per prompt; a shape no evaluation item is long enough for, or a
model without a chat template, is one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from optimize.errors import RecipeError
from optimize.evaluate.generation import GROUNDED_PROMPTS, Tokens, shape_prompts
from optimize.evaluate.grounded import grounded_requests
from optimize.workload import RequestPoint
from tests.support.models import tiny_llama_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("grounded") / "src")


def _tokens(folder: Path) -> Tokens:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return Tokens(SimpleNamespace(encoder=SimpleNamespace(tokenizer=tokenizer, folder=folder)))


def _paragraphs() -> list[str]:
    import calibration

    return calibration.load("cpython_docs", "evaluation", 60, 1).items


def test_a_grounded_shape_sends_each_paragraph_inside_the_chat_template(folder):
    from transformers import AutoTokenizer

    tokens, items = _tokens(folder), _paragraphs()
    prompts = shape_prompts(tokens, items, RequestPoint(48, 16, 1.0, "grounded"))
    assert 1 < len(prompts) <= GROUNDED_PROMPTS
    assert len({tuple(p) for p in prompts}) == len(prompts)  # one paragraph each
    chat = AutoTokenizer.from_pretrained(str(folder))
    asked = grounded_requests(len(prompts), 48, tokens, tokens.decode, texts=items)
    rendered = chat.apply_chat_template(asked[0], add_generation_prompt=True, tokenize=False)
    assert prompts[0] == tokens(rendered)
    content = asked[0][0]["content"]
    assert content in rendered and len(rendered) > len(content)  # the template's own words around it
    assert content.startswith("Correct any spelling") and asked[1][0]["content"].startswith("Summarise")
    paragraph = content.split("Paragraph:\n", 1)[1]
    assert 30 < len(tokens(paragraph)) <= 48  # about the 48 tokens asked, cut at a word boundary
    # the plain shape of the same size is cut from the same text, no template
    plain = shape_prompts(tokens, items, RequestPoint(48, 16, 1.0))
    assert all(len(p) == 48 for p in plain) and "Paragraph:" not in tokens.decode(plain[0])


def test_a_grounded_shape_longer_than_every_item_is_refused_in_one_line(folder):
    with pytest.raises(RecipeError) as err:
        shape_prompts(_tokens(folder), ["a short paragraph."], RequestPoint(96, 16, 1.0, "grounded"))
    assert "grounded:96x16" in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_a_chat_template_cannot_take_a_grounded_shape(folder, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(RecipeError, match="needs a chat template"):
        shape_prompts(_tokens(bare), _paragraphs(), RequestPoint(48, 16, 1.0, "grounded"))
