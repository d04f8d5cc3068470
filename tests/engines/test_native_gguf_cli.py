"""The native engine's refusals through `python -m optimize` as a user runs it: a GGUF whose norm
disagrees with its header, and a cache key others can read, are each one line and exit 2 (they were an
"internal error", exit 3, and silently trusted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from engines.native_gguf import build
from tests.support.cli import TINY_LM_RACE, one_error_line, run_optimize

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("gguf", "jinja2", "transformers")),
        reason="needs gguf, jinja2 and transformers",
    ),
]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    root = tmp_path_factory.mktemp("cli")
    return write_gguf(tiny_llama_folder(root / "hf"), root / "tiny.Q8_0.gguf", "Q8_0")


def _optimize(path: Path, tmp_path: Path, **env: str):
    return run_optimize(
        f"model.source={path}",
        *TINY_LM_RACE,
        "engine=native_gguf",
        f"output_dir={tmp_path / 'artifact'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config"), **env},
    )


@pytest.mark.skipif(build.unavailable() is not None, reason=f"{build.unavailable()}")
def test_a_norm_that_disagrees_with_the_header_is_exit_2_naming_it(source, tmp_path):
    from tests.support.gguf_writer import rewrite_gguf

    path = rewrite_gguf(source, tmp_path / "tiny.gguf", tensors={"blk.1.ffn_norm.weight": np.ones(32, np.float32)})
    proc = _optimize(path, tmp_path)
    # The baseline loads the file through transformers first: its loader names the weight (its own name).
    one_error_line(proc, "of another shape", "layers.1.post_attention_layernorm.weight", log_lines=True)
    assert not (tmp_path / "artifact").exists()


def test_a_cache_key_others_can_read_is_exit_2_in_one_line(source, tmp_path):
    key = tmp_path / "cache.key"
    key.write_text("a secret of at least sixteen bytes")
    key.chmod(0o644)
    proc = _optimize(source, tmp_path, OPTIMIZE_CACHE_KEY=str(key))
    one_error_line(proc, f"cache key file {key} is mode 0644: group or others can access it", log_lines=True)
    assert not (tmp_path / "artifact").exists()


@pytest.mark.skipif(build.unavailable() is not None, reason=f"{build.unavailable()}")
def test_a_nan_block_scale_is_exit_2_from_the_engine_stage_naming_the_tensor(source, tmp_path):
    """transformers loads it (the NaN only shows in the logits); the engine stage's contract refuses it."""
    from gguf import GGMLQuantizationType, GGUFReader

    from tests.support.gguf_writer import rewrite_gguf

    t = next(t for t in GGUFReader(str(source)).tensors if t.name == "blk.0.ffn_down.weight")
    raw = np.array(t.data)
    raw[0, 0:2] = np.array([0x7E00], np.uint16).view(np.uint8)
    path = rewrite_gguf(source, tmp_path / "tiny.gguf", tensors={t.name: (raw, GGMLQuantizationType.Q8_0)})
    proc = _optimize(path, tmp_path)
    one_error_line(proc, "engine.method=native_gguf", "blk.0.ffn_down.weight", "NaN or Inf", log_lines=True)
