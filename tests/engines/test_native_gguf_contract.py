"""The native kernels' contract (engines/native_gguf/contract.py): every value kernels.c reads is checked
in Python before it reaches C, so a hostile or broken GGUF is one line naming the field or tensor —
never a read past a buffer, a truncated count, a traceback, or a model whose every logit is NaN.
Each case here loaded before the contract was written (most of them silently)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from engines.native_gguf import build

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "transformers")), reason="needs gguf and transformers"
)
needs_kernels = pytest.mark.skipif(build.unavailable() is not None, reason=f"{build.unavailable()}")


def mixed(name: str) -> str:
    """Every carried type in one file: Q 4-bit with offsets (Q4_1), K symmetric (Q4_0), down and the
    embedding 8-bit (Q8_0)."""
    for part, kind in (("attn_q", "Q4_1"), ("attn_k", "Q4_0"), ("ffn_down", "Q8_0"), ("token_embd", "Q8_0")):
        if part in name:
            return kind
    return "Q4_1"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny Llama's folder, its GGUF with every carried type)."""
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    root = tmp_path_factory.mktemp("contract")
    folder = tiny_llama_folder(root / "hf")
    return folder, write_gguf(folder, root / "model.gguf", mixed)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    shared = tmp_path_factory.getbasetemp() / "native-contract-cache"
    monkeypatch.setenv("OPTIMIZE_CACHE", str(shared / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(shared / "config"))
    monkeypatch.delenv("OPTIMIZE_CACHE_KEY", raising=False)


def _tensor(path: Path, name: str):
    from gguf import GGUFReader

    return next(t for t in GGUFReader(str(path)).tensors if t.name == name)


def _refused(path: Path, *words: str, **kwargs) -> str:
    """NativeGGUF(path) refuses in one line naming each of `words`."""
    from engines.native_gguf.model import NativeGGUF, NativeModelError

    with pytest.raises(NativeModelError) as caught:
        NativeGGUF(path, **kwargs)
    line = str(caught.value)
    assert "\n" not in line and all(w in line for w in words), line
    return line


def _with_tensor(source, tmp_path, name, data) -> Path:
    from tests.support.gguf_writer import rewrite_gguf

    return rewrite_gguf(source[1], tmp_path / "edited.gguf", tensors={name: data})


def _with_field(source, tmp_path, key, value) -> Path:
    from tests.support.gguf_writer import rewrite_gguf

    return rewrite_gguf(source[1], tmp_path / "edited.gguf", fields={key: value})


# --- norms --------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize(
    "name, data",
    [
        ("blk.0.attn_norm.weight", np.ones(32, np.float32)),  # 32 of 64 values: rms_norm read 32 floats past it
        ("blk.1.ffn_norm.weight", np.ones(1, np.float32)),
        ("output_norm.weight", np.ones(16, np.float16)),
    ],
)
def test_a_norm_shorter_than_the_width_is_refused(source, tmp_path, name, data):
    _refused(_with_tensor(source, tmp_path, name, data), name, "[64]")


@needs_kernels
def test_a_norm_stored_as_a_quantized_matrix_is_refused(source, tmp_path):
    from gguf import GGMLQuantizationType, quants

    matrix = quants.quantize(np.ones((32, 64), np.float32), GGMLQuantizationType.Q8_0)
    path = _with_tensor(source, tmp_path, "blk.0.ffn_norm.weight", (matrix, GGMLQuantizationType.Q8_0))
    _refused(path, "blk.0.ffn_norm.weight")


@needs_kernels
def test_a_norm_holding_nan_is_refused(source, tmp_path):
    values = np.ones(64, np.float32)
    values[5] = np.nan
    _refused(_with_tensor(source, tmp_path, "output_norm.weight", values), "output_norm.weight", "not finite")


# --- the embedding and the head -----------------------------------------------------------------


@needs_kernels
def test_an_embedding_or_head_that_disagrees_with_the_header_is_refused(source, tmp_path):
    from gguf import GGMLQuantizationType, quants

    q8 = GGMLQuantizationType.Q8_0
    short_rows = quants.quantize(np.ones((512, 32), np.float32), q8)  # rows of 32, not the width 64
    _refused(_with_tensor(source, tmp_path, "token_embd.weight", (short_rows, q8)), "token_embd.weight", "[32, 512]")
    head = quants.quantize(np.ones((256, 64), np.float32), q8)  # half the vocabulary
    _refused(_with_tensor(source, tmp_path, "output.weight", (head, q8)), "output.weight", "[64, 256]")
    flat = np.ones(512 * 64, np.float32)  # 1-D: an IndexError traceback before
    _refused(_with_tensor(source, tmp_path, "token_embd.weight", flat), "token_embd.weight", "[32768]")


# --- context ------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("context", [2**32 + 16, -1, 2**20 + 1, 2.5, "4096", True])
def test_a_context_that_does_not_fit_the_kernels_is_refused(source, tmp_path, context):
    """2**32+16 was a KV cache of 16 positions (ctypes truncated it) while positions up to 2**32+16 passed."""
    from gguf import GGUFValueType

    path = _with_field(source, tmp_path, "llama.context_length", (2**33, GGUFValueType.UINT64))
    _refused(path, "context", context=context)


@needs_kernels
def test_an_engine_blocks_context_is_checked_when_the_runner_loads(source, tmp_path):
    from engines.native_gguf.model import NativeModelError
    from engines.native_gguf.runner import load_native_gguf_runner

    folder = tmp_path / "engine"
    folder.mkdir()
    shutil.copyfile(source[1], folder / "model.gguf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source[0] / name, folder / name)
    with pytest.raises(NativeModelError, match="context"):
        load_native_gguf_runner(tmp_path, {"dir": "engine", "gguf": "model.gguf", "context": 2**32 + 16})
    runner = load_native_gguf_runner(tmp_path, {"dir": "engine", "gguf": "model.gguf", "context": 64})
    assert runner.context_length == 64 and runner.model.step(1, 63).shape == (512,)


# --- numbers that make every logit NaN ----------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize(
    "key, value",
    [
        ("llama.rope.freq_base", 0.0),
        ("llama.rope.freq_base", float("nan")),
        ("llama.rope.freq_base", -10000.0),
        ("llama.attention.layer_norm_rms_epsilon", 0.0),
        ("llama.attention.layer_norm_rms_epsilon", -1e-5),
        ("llama.attention.layer_norm_rms_epsilon", float("nan")),
        ("llama.attention.layer_norm_rms_epsilon", float("inf")),
        ("llama.attention.layer_norm_rms_epsilon", 1e-50),  # 0 as the f32 the kernels take
    ],
)
def test_a_float_that_is_not_finite_and_positive_is_refused(source, tmp_path, key, value):
    from gguf import GGUFValueType

    kind = GGUFValueType.FLOAT32 if abs(value) != 1e-50 else GGUFValueType.FLOAT64
    _refused(_with_field(source, tmp_path, key, (value, kind)), key, "finite number above 0")


@needs_kernels
def test_a_count_that_is_not_a_whole_number_is_refused(source, tmp_path):
    from gguf import GGUFValueType

    _refused(_with_field(source, tmp_path, "llama.block_count", (2.5, GGUFValueType.FLOAT32)), "block_count", "2.5")
    # A whole number stored as a float is still the count.
    path = _with_field(source, tmp_path, "llama.block_count", (2.0, GGUFValueType.FLOAT32))
    from engines.native_gguf.model import NativeGGUF

    assert NativeGGUF(path).hyper.layers == 2


NAN16, INF16 = 0x7E00, 0x7C00


@needs_kernels
@pytest.mark.parametrize(
    "name, kind, at, bits",
    [
        ("blk.0.ffn_down.weight", "Q8_0", 0, NAN16),
        ("blk.1.attn_q.weight", "Q4_1", 0, INF16),
        ("blk.0.attn_q.weight", "Q4_1", 2, NAN16),  # the offset (min)
        ("blk.1.attn_k.weight", "Q4_0", 0, NAN16 | 0x8000),
        ("token_embd.weight", "Q8_0", 0, INF16 | 0x8000),
    ],
)
def test_a_block_scale_that_is_nan_or_inf_is_refused(source, tmp_path, name, kind, at, bits):
    from gguf import GGMLQuantizationType

    t = _tensor(source[1], name)
    assert t.tensor_type.name == kind
    raw = np.array(t.data, dtype=np.uint8)
    raw[3, at : at + 2] = np.array([bits], np.uint16).view(np.uint8)  # row 3's first block
    path = _with_tensor(source, tmp_path, name, (raw, GGMLQuantizationType[kind]))
    _refused(path, name, kind, "NaN or Inf")


@needs_kernels
def test_a_data_offset_misaligned_or_overlapping_another_is_refused(source, tmp_path):
    from tests.support.gguf_writer import edit_tensor_info, tensor_offsets

    offsets = tensor_offsets(source[1])
    misaligned = tmp_path / "misaligned.gguf"
    shutil.copyfile(source[1], misaligned)
    edit_tensor_info(misaligned, "blk.0.attn_norm.weight", offset=offsets["blk.0.attn_norm.weight"] + 1)
    _refused(misaligned, "blk.0.attn_norm.weight", "alignment 32")
    overlapping = tmp_path / "overlapping.gguf"
    shutil.copyfile(source[1], overlapping)
    edit_tensor_info(overlapping, "blk.1.ffn_norm.weight", offset=offsets["blk.1.attn_norm.weight"])
    _refused(overlapping, "overlaps")


def test_the_contract_in_kernels_c_lists_what_contract_py_checks():
    """The comment above ng_new and contract.py's docstring name the same items, in the same order."""
    import re

    from engines.native_gguf import contract

    source = (Path(build.SOURCE)).read_text()
    c_items = re.findall(r"^ \* (\d)\. ", source[: source.index("model *ng_new(")], re.M)
    py_items = re.findall(r"^(\d)\. ", contract.__doc__ or "", re.M)
    assert c_items == py_items == [str(i) for i in range(1, 8)]
