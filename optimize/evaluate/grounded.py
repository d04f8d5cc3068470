"""Input-grounded prompts: each gives the model a paragraph and asks for it back edited, or condensed
in its own words, so most of the answer is already in the prompt. Prompt lookup (n-gram speculation
from the prompt, engines/openvino/genai_batch.py) pays on this kind of request, and barely on one
whose answer is new text. A workload shape built from these prompts is named `grounded` (for example
`grounded:256x128`: paragraphs of about 256 prompt tokens, 128 new tokens) beside the plain
`PROMPTxOUTPUT` shapes of optimize/workload.py.

The paragraphs are the held-out CPython documentation the other LM timings read (calibration's
`cpython_docs`, evaluation split), so the figures do not depend on the network or on a data set.
"""

from __future__ import annotations

from typing import Callable

SHAPE_KIND = "grounded"
# What the model is asked to do with the paragraph. Each keeps most of the paragraph in the answer.
TASKS = {
    "edit": (
        "Correct any spelling, grammar or punctuation mistakes in the paragraph below and give the "
        "whole corrected paragraph back, changing nothing else.\n\nParagraph:\n{text}"
    ),
    "summarise": (
        "Summarise the paragraph below in a few sentences, keeping its own wording and its technical "
        "terms exactly as they are written.\n\nParagraph:\n{text}"
    ),
}


def grounded_messages(paragraph: str, task: str = "edit") -> list[dict]:
    """One chat request about `paragraph` (the chat template makes it the model's prompt)."""
    if task not in TASKS:
        raise ValueError(f"grounded task {task!r}: use one of {', '.join(TASKS)}")
    return [{"role": "user", "content": TASKS[task].format(text=paragraph.strip())}]


def grounded_paragraphs(
    count: int,
    tokens: int,
    tokenize: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    texts: list[str] | None = None,
) -> list[str]:
    """`count` paragraphs of about `tokens` tokens each from `texts` (by default the held-out CPython
    documentation; longer ones cut at a word boundary before the limit); refuses, naming the
    shortfall, when too few are that long."""
    if texts is None:
        import calibration

        texts = calibration.load("cpython_docs", "evaluation", 100, 1).items
    out = []
    for text in texts:
        ids = tokenize(text)
        if len(ids) < tokens:
            continue
        cut = decode(ids[:tokens])
        out.append(cut.rsplit(" ", 1)[0] if len(ids) > tokens else cut)
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} held-out paragraphs have {tokens} tokens; {count} needed")


def grounded_requests(
    count: int,
    tokens: int,
    tokenize: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    tasks: tuple[str, ...] = ("edit", "summarise"),
    texts: list[str] | None = None,
) -> list[list[dict]]:
    """`count` chat requests, the tasks taken in turn over distinct paragraphs (of `texts`, else the
    held-out CPython documentation)."""
    paragraphs = grounded_paragraphs(count, tokens, tokenize, decode, texts)
    return [grounded_messages(p, tasks[i % len(tasks)]) for i, p in enumerate(paragraphs)]
