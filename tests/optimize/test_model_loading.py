"""A model that does not load completely is refused (one line naming the tensors, exit 2), and the GGUF
conversion cache (OPTIMIZE_CACHE/gguf/<sha>/) is used only when it verifies, rebuilt otherwise, and
safe for two runs converting the same file at once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from optimize import cache_store
from optimize.errors import RecipeError
from optimize.sources import models

pytestmark = pytest.mark.slow  # each loads a model with transformers


def _cfg(source: Path):
    return OmegaConf.create(
        {
            "source": str(source),
            "task": "causal_lm",
            "max_length": 64,
            "allow_pickle": False,
            "trust_remote_code": False,
            "revision": None,
            "gguf_file": None,
            "tokenizer": None,
        }
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama folder (safetensors) and the same model as a Q8_0 GGUF."""
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    work = tmp_path_factory.mktemp("tiny")
    folder = tiny_llama_folder(work / "src")
    return folder, write_gguf(folder, work / "tiny.Q8_0.gguf", "Q8_0")


def _edited_copy(folder: Path, out: Path, drop: str = "", add: str = "") -> Path:
    """The folder with one tensor dropped from, or one added to, its model.safetensors."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(folder / "model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(4)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"drop": "model.layers.1.mlp.up_proj.weight"}, "1 missing (model.layers.1.mlp.up_proj.weight)"),
        ({"add": "model.layers.7.extra.weight"}, "1 unexpected (model.layers.7.extra.weight)"),
    ],
)
def test_a_checkpoint_missing_or_adding_a_tensor_is_refused_naming_it(tiny, tmp_path, edit, named):
    source = _edited_copy(tiny[0], tmp_path / "edited", **edit)
    with pytest.raises(RecipeError) as refused:
        models.load(_cfg(source))
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_a_gguf_with_a_renamed_tensor_is_refused_naming_it(tiny, tmp_path):
    data = tiny[1].read_bytes()
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(data.replace(b"token_embd.weight", b"token_embx.weight"))
    with pytest.raises(RecipeError, match="token_embx.weight"):
        models.load(_cfg(renamed))


def test_the_gguf_conversion_cache_is_rebuilt_when_it_does_not_verify(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    source = models.load(_cfg(tiny[1]))
    folder = models.hf_folder(source)
    weights = (folder / "model.safetensors").read_bytes()
    assert models.hf_folder(source) == folder and "rebuilt" not in caplog.text  # reused as it is

    (folder / "model.safetensors").write_bytes(
        _edited_copy(tiny[0], tmp_path / "other").joinpath("model.safetensors").read_bytes()
    )
    with caplog.at_level(logging.WARNING):
        assert models.hf_folder(source) == folder
    assert "not used, rebuilt: its files differ" in caplog.text and "model.safetensors" in caplog.text
    assert (folder / "model.safetensors").read_bytes() == weights
    assert cache_store.open_verified(folder, "gguf:" + source_sha(tiny[1])) == (True, "")


def source_sha(path: Path) -> str:
    from engines.artifact import sha256_file

    return sha256_file(path)


CONVERTER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tests.optimize.test_model_loading import _cfg
    from optimize.sources import models

    source = models.load(_cfg(Path(sys.argv[1])))
    print(models.hf_folder(source))
    """
)


def test_two_runs_converting_the_same_gguf_at_once_both_succeed(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # the cache key, shared with the runs
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OPTIMIZE_CACHE": str(tmp_path / "cache")}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERTER, str(tiny[1])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-2000:]
        outs.append(out.strip().splitlines()[-1])
    assert outs[0] == outs[1]
    folder = Path(outs[0])
    assert cache_store.open_verified(folder, "gguf:" + source_sha(tiny[1])) == (True, "")
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left
