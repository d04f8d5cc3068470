"""The streaming detokenizer (engines/text_stream.py): token by token it writes what the engine's
decode writes for the whole sequence, multi-byte characters split over byte tokens included; it is
refused when the tokenizer file is missing, broken or writes other text; and OpenVINO GenAI's
continuous-batching engine streams through it."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from engines.text_stream import CHECK_TEXTS, hf_streams


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory) -> Path:
    """A byte-level BPE of 512 tokens: characters outside its merges are split into byte tokens."""
    from tests.support.models import train_tokenizer

    folder = tmp_path_factory.mktemp("bpe")
    train_tokenizer(folder)
    return folder / "tokenizer.json"


def _reference(tokenizer_json: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    return tokenizer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def test_streams_what_the_whole_decode_writes_multibyte_and_special_tokens_included(byte_bpe):
    tokenizer, decode = _reference(byte_bpe)
    eos = tokenizer.token_to_id("<|endoftext|>") or 0
    streams = hf_streams(byte_bpe, decode, [eos])
    assert streams is not None
    text = "naïve café 日本語 😀 and code: x = {'a': [1, 2]}\n"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.encode()) // 2  # the 512-token BPE splits it into many byte tokens
    stream = streams()
    pieces = [stream.decode(token) for token in ids + [eos]]
    assert "".join(pieces) == decode(ids) == text
    # No piece is a broken character: each holds whole characters, or nothing while one is incomplete.
    assert all("\ufffd" not in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # a character split over byte tokens waits for its last


def test_one_tokens_text_is_the_engines_a_byte_of_a_character_included(byte_bpe, caplog):
    tokenizer, decode = _reference(byte_bpe)
    streams = hf_streams(byte_bpe, decode, [])
    assert streams is not None
    byte_tokens = [t for t in tokenizer.encode("日本語 😀", add_special_tokens=False).ids if decode([t]) == "\ufffd"]
    assert byte_tokens and all(streams.decode([t]) == "\ufffd" for t in byte_tokens)

    # An engine that writes a lone byte otherwise (as nothing, say) keeps its own decode.
    caplog.set_level(logging.INFO, "engines")
    assert hf_streams(byte_bpe, lambda ids: decode(ids).replace("\ufffd", ""), []) is None
    assert "writes '\ufffd' where the engine writes ''" in caplog.text


def test_refused_where_it_would_write_other_text(byte_bpe, caplog):
    caplog.set_level(logging.INFO, "engines")
    _, decode = _reference(byte_bpe)
    assert hf_streams(byte_bpe, lambda ids: decode(ids).strip(), []) is None  # another decode
    assert "writes" in caplog.text
    assert hf_streams(None, decode, []) is None
    assert hf_streams(byte_bpe.parent / "absent.json", decode, []) is None
    folder = byte_bpe.parent / "a_folder.json"
    folder.mkdir()
    assert hf_streams(folder, decode, []) is None  # a folder where the file is expected
    broken = byte_bpe.parent / "broken.json"
    broken.write_text("{not json")
    assert hf_streams(broken, decode, []) is None
    assert "does not load" in caplog.text


def test_the_check_covers_every_sample_text_and_the_special_tokens(byte_bpe):
    from engines.text_stream import check_sequences

    tokenizer, _ = _reference(byte_bpe)
    sequences = check_sequences(tokenizer, [7, 9])
    texts = sequences[: 2 * len(CHECK_TEXTS)]
    joined = [tokenizer.decode(s) for s in texts[::2]]
    assert joined == list(CHECK_TEXTS)  # the byte-level BPE holds every sample exactly
    assert all(s[:2] == [7, 9] and s[-2:] == [7, 9] for s in texts[1::2])
    added = set(tokenizer.get_added_tokens_decoder())
    assert added and added <= {i for s in sequences[len(texts) :] for i in s}  # every added token placed


def test_an_added_token_the_engine_writes_where_the_file_skips_it_is_refused(byte_bpe):
    tokenizer, decode = _reference(byte_bpe)
    added = sorted(tokenizer.get_added_tokens_decoder())
    assert added  # the trained BPE lists its special tokens (<|endoftext|>, ...)
    writes_them = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert hf_streams(byte_bpe, writes_them, []) is None  # even with no special id given to the check


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("openvino", "openvino_genai", "openvino_tokenizers")),
    reason="needs openvino, openvino-genai and openvino-tokenizers",
)
def test_openvino_genai_batch_engine_streams_its_own_decode(tmp_path):
    from engines.generation import BatchSettings, Sampling
    from engines.openvino.genai_batch import OVGenAIBatchEngine
    from engines.openvino.genai_build import export_stateful_lm
    from tests.engines.test_openvino_genai import varied_llama_folder

    src = varied_llama_folder(tmp_path / "src")
    ov_dir = export_stateful_lm(src, tmp_path / "ov").parent
    settings = BatchSettings(max_num_seqs=2, kv_cache_bytes=1 << 22)
    engine = OVGenAIBatchEngine(ov_dir, settings, threads=1, tokenizer_json=src / "tokenizer.json")
    assert engine.text_stream() is not None
    plain = OVGenAIBatchEngine(ov_dir, settings, threads=1)  # no tokenizer.json given: its own decode
    assert plain.text_stream() is None
    assert "text streamed by tokenizers" in engine.describe()  # the server's startup line says which
    assert "text streamed by the engine" in plain.describe()

    prompts = [engine.encode("Return the größte Zahl: "), engine.encode("def main():")]
    handles = [engine.add(i, p, Sampling(max_new_tokens=24)) for i, p in enumerate(prompts)]
    streams = [engine.text_stream() for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    text = ["" for _ in prompts]
    while engine.has_work():
        engine.step()
        for i, handle in enumerate(handles):
            new, _ = engine.read(handle)
            ids[i] += new
            text[i] += "".join(streams[i].decode(t) for t in new)
    assert all(len(i) == 24 for i in ids)
    assert text == [plain.decode(i) for i in ids]  # the engine's own decode (the detokenizer IR)
    assert [engine.decode(i) for i in ids] == text  # decode() by tokenizers now
    tokens = sorted({t for i in ids for t in i})
    assert [engine.decode([t]) for t in tokens] == [plain.decode([t]) for t in tokens]  # logprobs' token texts
