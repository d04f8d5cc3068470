"""A read-only file mapping's pages given back (engines/file_pages.py): not resident afterwards, the
same bytes on the next read; a writable mapping refused; the native GGUF engine's load gives each
layer's file pages back once it has repacked them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from engines import file_pages
from engines.pytorch.weight_pages import mappings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps: Linux")


def _resident(path: Path) -> int:
    return sum(m.rss for m in mappings() if m.path == str(path))


def test_a_read_only_mapping_is_given_back_and_reads_the_same_bytes_again(tmp_path):
    path = tmp_path / "blocks.bin"
    content = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    content.tofile(path)
    mapped = np.memmap(path, mode="r")
    assert int(mapped.sum(dtype=np.int64)) == int(content.sum(dtype=np.int64))
    assert _resident(path) >= 4 << 20
    assert file_pages.give_back_read_only(mapped)
    assert _resident(path) == 0
    assert np.array_equal(mapped, content) and _resident(path) >= 4 << 20


def test_a_writable_mapping_or_a_plain_array_is_refused(tmp_path):
    path = tmp_path / "blocks.bin"
    np.zeros(1 << 20, np.uint8).tofile(path)
    writable = np.memmap(path, mode="r+")
    writable[0] = 7  # the only copy of this byte until it is flushed
    assert not file_pages.give_back_read_only(writable)
    assert writable[0] == 7 and _resident(path) > 0
    assert not file_pages.give_back_read_only(np.zeros(16, np.uint8))


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf")
def test_the_native_engine_gives_each_layers_file_pages_back_as_it_loads(tmp_path, monkeypatch):
    from engines.native_gguf import build

    if build.unavailable() is not None:
        pytest.skip(build.unavailable())
    from engines.native_gguf.model import NativeGGUF
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    path = write_gguf(tiny_llama_folder(tmp_path / "llama"), tmp_path / "model.gguf", "Q8_0")
    after_each: list[int] = []
    real = file_pages.give_back_read_only

    def give_back_and_look(array) -> bool:
        given = real(array)
        after_each.append(_resident(path))
        return given

    monkeypatch.setattr(file_pages, "give_back_read_only", give_back_and_look)
    model = NativeGGUF(path, context=64)
    assert len(after_each) == model.hyper.layers + 1  # after every layer, then after the head
    assert after_each == [0] * len(after_each)
