"""The baseline's memory-mapped weight pages given back while it idles, and read again by its next
forward: the same logits before and after, and a mapping with a written page never given back (a
private mapping's written page would be read again from the file, silently changing a weight)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engines.pytorch import weight_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps: Linux")


def _bf16_model(out: Path):
    import torch

    from engines.pytorch.runner import TorchLM, load_hf_model
    from tests.support.models import train_tokenizer
    from tests.support.tiny_archs import tiny_model

    tiny_model("llama", train_tokenizer(out)).to(torch.bfloat16).save_pretrained(out, max_shard_size="200KB")
    return TorchLM(load_hf_model(str(out), "causal_lm", precision="bfloat16"))


def _resident(model) -> int:
    return sum(m.rss for m in weight_pages.weight_mappings(model))


def test_the_weight_pages_are_given_back_and_read_again_by_the_next_forward(tmp_path):
    held = _bf16_model(tmp_path / "model")
    ids = list(range(1, 40))
    before = held.logits(ids)
    shards = {m.path for m in weight_pages.weight_mappings(held.model)}
    assert shards == {str(p) for p in (tmp_path / "model").glob("*.safetensors")} and len(shards) > 1
    resident = _resident(held.model)
    assert resident > 0
    assert held.release_weight_pages() == resident
    assert _resident(held.model) == 0
    assert np.array_equal(held.logits(ids), before)
    assert _resident(held.model) == resident


def test_a_mapping_with_a_written_page_is_kept_and_its_weight_survives(tmp_path):
    import torch

    held = _bf16_model(tmp_path / "model")
    weight = held.model.lm_head.weight
    with torch.no_grad():
        weight[0, 0] = 7.0  # copy on write: that page is now the process's own, not the file's
    written = [m for m in weight_pages.weight_mappings(held.model) if not m.clean_file_pages]
    assert len(written) == 1 and written[0].written > 0
    released = held.release_weight_pages()
    assert 0 < released < sum(m.rss for m in weight_pages.weight_mappings(held.model)) + released
    assert weight[0, 0].item() == 7.0
    assert all(m.rss > 0 for m in weight_pages.weight_mappings(held.model) if not m.clean_file_pages)


def test_a_model_in_private_memory_gives_nothing_back():
    import torch

    model = torch.nn.Linear(64, 64)
    assert weight_pages.weight_mappings(model) == [] and weight_pages.release(model) == 0


def test_smaps_is_read_by_mapping_with_what_was_written():
    text = (
        "7f0000000000-7f0000010000 rw-p 00000000 08:01 42 /models/a.safetensors\n"
        "Rss:                  64 kB\nPrivate_Dirty:         64 kB\nAnonymous:              0 kB\n"
        "7f0000010000-7f0000020000 rw-p 00000000 08:01 43 /models/b.safetensors\n"
        "Rss:                  64 kB\nPrivate_Dirty:          4 kB\nAnonymous:              4 kB\n"
        "7f0000020000-7f0000030000 rw-p 00000000 00:00 0 \nRss:                  64 kB\n"
    )
    a, b, anon = weight_pages.mappings(text)
    assert (a.start, a.end, a.path) == (0x7F0000000000, 0x7F0000010000, "/models/a.safetensors")
    assert (a.rss, a.written) == (65536, 0)
    # Private_Dirty alone is a file written moments ago, still dirty in the page cache: not a write here.
    assert a.clean_file_pages and not b.clean_file_pages and b.written == 4096
    assert anon.path == "" and not anon.clean_file_pages


def test_the_gguf_build_gives_back_the_source_pages_its_writer_read(tmp_path):
    # The race's GGUF builder writes the file from the memory-mapped model, then hands the file to the
    # runtime that gates it (OpenVINO's reader compiles its own copy): the source's pages the writer read
    # are given back between the two.
    from optimize.compile.gguf_export import give_back_source_pages
    from optimize.context import Model
    from optimize.export.gguf import writer

    held = _bf16_model(tmp_path / "model")
    writer.write(held.model, tmp_path / "model.gguf", "Q8_0", tokenizer_dir=tmp_path / "model")
    assert _resident(held.model) > 0
    give_back_source_pages(Model(kind="torch", task="causal_lm", module=held.model))
    assert _resident(held.model) == 0
