"""The sources people bring for a 1B-8B causal LM, on tiny files written here: bf16 / fp16 safetensors
folders (sharded) kept in their own precision, memory-mapped, and scored in FP32 a module at a time
(the same log-probabilities as the model held in FP32); GGUF files of Q4_K_M, Q5_K_M, Q6_K and Q8_0
of the Llama, Mistral, Qwen2 and Gemma families converted a tensor at a time into exactly what
transformers' loader gives, or refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from optimize.errors import RecipeError
from optimize.evaluate import token_fidelity as tf
from optimize.sources import models


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


# ---------------------------------------------------------------- without a model


def _write_safetensors(path: Path, dtypes: dict[str, str]) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({name: torch.zeros(2, 2, dtype=getattr(torch, dtype)) for name, dtype in dtypes.items()}, str(path))


@pytest.mark.parametrize(
    "shards, precision",
    [
        ([{"a": "bfloat16"}, {"b": "bfloat16", "steps": "int64", "mask": "bool"}], "bfloat16"),
        ([{"a": "float16"}], "float16"),
        ([{"a": "bfloat16"}, {"b": "float32"}], "float32"),  # mixed: FP32, as before
        ([{"a": "float32"}], "float32"),
    ],
)
def test_the_baseline_is_held_in_the_checkpoints_own_half_precision(tmp_path, shards, precision):
    from engines.pytorch.runner import source_precision

    for i, tensors in enumerate(shards):
        _write_safetensors(tmp_path / f"model-{i}.safetensors", tensors)
    assert source_precision(tmp_path) == precision
    assert source_precision(None) == "float32"  # a hub id


class _Logits:
    """A runner whose logits are a fixed function of the ids (large enough to span many row chunks)."""

    def logits(self, ids):
        rng = np.random.default_rng(len(ids) * 7919 + int(ids[0]))
        return rng.normal(0, 3, (len(ids), 1000)).astype(np.float32)


def test_the_reference_scored_a_few_rows_at_a_time_equals_it_scored_whole(monkeypatch):
    texts = {"prose": list(range(1, 300)), "code": list(range(5, 200))}
    monkeypatch.setattr(tf, "ROWS", 1 << 20)
    whole = tf.reference(_Logits(), texts, 128, k=16)
    figures_whole = tf.compare(whole, _Logits(), texts, 128)
    monkeypatch.setattr(tf, "ROWS", 5)
    chunked = tf.reference(_Logits(), texts, 128, k=16)
    for field in tf.FIELDS:
        assert np.array_equal(getattr(whole, field), getattr(chunked, field)), field
    assert tf.compare(chunked, _Logits(), texts, 128) == figures_whole


@pytest.mark.slow
def test_a_gguf_too_large_for_this_machine_is_refused_at_plan_time_in_one_line(gguf_files, monkeypatch):
    from optimize.sources import gguf_header

    monkeypatch.setattr(gguf_header, "_physical_memory", lambda: 1 << 20)
    with pytest.raises(RecipeError) as refused:
        models.resolve(_cfg(gguf_files["llama", "Q4_K_M"]))
    text = str(refused.value)
    assert "GiB in FP32" in text and "more than this machine's 0.0 GiB of memory" in text and "\n" not in text


@pytest.mark.slow
def test_a_gguf_whose_conversion_does_not_fit_the_disk_is_refused_before_writing(gguf_files, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 0))
    with pytest.raises(RecipeError, match=r"its FP32 conversion needs .* GiB of disk under .*, 0.0 GiB free"):
        models.converted_folder(gguf_files["llama", "Q8_0"])
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written


# ---------------------------------------------------------------- bf16 / fp16 safetensors folders


def _half_folder(out: Path, dtype: str) -> Path:
    """A tiny Llama saved in `dtype`, sharded (model.safetensors.index.json), with its tokenizer."""
    import torch

    from tests.support.models import train_tokenizer
    from tests.support.tiny_archs import tiny_model

    vocab = train_tokenizer(out)
    tiny_model("llama", vocab).to(getattr(torch, dtype)).save_pretrained(out, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 2
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_sharded_half_precision_folder_is_carried_in_its_precision_and_scores_as_fp32(tmp_path, dtype, caplog):
    import logging

    import torch

    from engines.pytorch.runner import TorchLM, load_hf_model

    folder = _half_folder(tmp_path / "model", dtype)
    with caplog.at_level(logging.INFO, logger="optimize.sources.models"):
        source = models.load(_cfg(folder))
    (line,) = [r.getMessage() for r in caplog.records if "carried" in r.getMessage()]
    assert f"safetensors ({len(list(folder.glob('*.safetensors')))} files): carried in {dtype}" in line
    params = dict(source.module.named_parameters())
    assert {p.dtype for p in params.values()} == {getattr(torch, dtype)}  # no FP32 copy of any weight
    pointers = {name: p.data_ptr() for name, p in params.items()}

    held = TorchLM(source.module)
    resident = TorchLM(load_hf_model(str(folder), "causal_lm"))  # today's baseline: the FP32 copy
    assert next(resident.model.parameters()).dtype == torch.float32
    ids = list(range(1, 50))
    assert np.array_equal(held.logits(ids), resident.logits(ids))  # FP32 a module at a time: bit for bit
    texts = {"prose": list(range(1, 120)), "code": list(range(3, 90))}
    streamed, whole = tf.reference(held, texts, 32), tf.reference(resident, texts, 32)
    for field in tf.FIELDS:
        assert np.array_equal(getattr(streamed, field), getattr(whole, field)), field

    after = dict(source.module.named_parameters())  # the held weights put back, not replaced
    assert {p.dtype for p in after.values()} == {getattr(torch, dtype)}
    assert {name: p.data_ptr() for name, p in after.items()} == pointers
    generated = held.greedy(ids[:8], 4)  # generation runs in the checkpoint's precision
    assert len(generated) == 4


# ---------------------------------------------------------------- GGUF files

FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gemma3")
# llama.cpp's mixes, as its quantizer lays them out for these models: Q4_K_M and Q5_K_M keep
# attn_v, ffn_down and the output matrix in Q6_K.
MIXES = {
    "Q4_K_M": lambda name: "Q6_K" if _sensitive(name) else "Q4_K",
    "Q5_K_M": lambda name: "Q6_K" if _sensitive(name) else "Q5_K",
    "Q6_K": "Q6_K",
    "Q8_0": "Q8_0",
}


def _sensitive(name: str) -> bool:
    return any(part in name for part in ("attn_v", "ffn_down", "output.weight"))


def _k_quant_folder(arch: str, out: Path) -> Path:
    """A tiny model of `arch` whose rows (256 values) fill K-quant super-blocks, so the matrices are
    written in the K-quant types themselves rather than llama.cpp's fallbacks."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.models import train_tokenizer
    from tests.support.tiny_archs import tiny_config

    vocab = train_tokenizer(out)
    config = tiny_config(arch, vocab)
    config.hidden_size = config.intermediate_size = 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.rand_like(param) * 0.2)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict:
    from tests.support.gguf_writer import write_gguf

    work = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch in FAMILIES:
        folder = _k_quant_folder(arch, work / arch)
        for mix, qtype in MIXES.items():
            files[arch, mix] = write_gguf(folder, work / f"{arch}-{mix}.gguf", qtype)
    gemma = _k_quant_folder("gemma2", work / "gemma-1")
    files["gemma", "Q8_0"] = write_gguf(gemma, work / "gemma-Q8_0.gguf", "Q8_0", architecture="gemma")
    return files


@pytest.mark.slow
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("arch", FAMILIES)
def test_each_gguf_family_and_type_is_carried_exactly_as_transformers_loads_it(
    gguf_files, arch, mix, tmp_path, monkeypatch, caplog
):
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    path = gguf_files[arch, mix]
    with caplog.at_level(logging.INFO, logger="optimize.sources.gguf_header"):
        source = models.load(_cfg(path))
    lines = [r.getMessage() for r in caplog.records if "carried" in r.getMessage()]
    assert len(lines) == 1 and f"GGUF {'llama' if arch == 'mistral' else arch}, 2 layers" in lines[0]
    wanted = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K"), "Q6_K": ("Q6_K",), "Q8_0": ("Q8_0",)}[mix]
    assert all(f"{kind} x" in lines[0] for kind in wanted), lines[0]

    transformers_own = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours, theirs = source.module.state_dict(), transformers_own.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours), "a tensor differs from transformers' load"
    assert models.hf_folder(source) == models.converted_folder(path)  # the builders read the same folder


@pytest.mark.slow
def test_a_gguf_family_transformers_cannot_load_is_refused_naming_it_and_what_loads(gguf_files):
    with pytest.raises(RecipeError) as refused:
        models.resolve(_cfg(gguf_files["gemma", "Q8_0"]))
    text = str(refused.value)
    assert "GGUF architecture 'gemma' is not a causal LM that transformers" in text
    assert "llama" in text and "qwen2" in text and "gemma2" in text and "\n" not in text


@pytest.mark.slow
def test_the_conversion_holds_one_shard_at_a_time_and_sharded_folders_load(gguf_files, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from optimize.sources.gguf_convert import convert

    path = gguf_files["qwen2", "Q4_K_M"]
    convert(path, tmp_path / "sharded", shard_bytes=256 << 10)
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    assert index.is_file() and len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    convert(path, tmp_path / "whole")
    a = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded"), dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole"), dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- no private FP32 copy

HOLDER = """
import sys
from pathlib import Path
from tests.optimize.test_lm_sources import _cfg
from optimize.sources import models
from engines.pytorch.runner import TorchLM


def private_bytes():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))


# A tiny model of the same kind first: the imports and caches a first load brings are not the weights.
warm = models.load(_cfg(Path(sys.argv[2])))
TorchLM(warm.module).logits([1, 2, 3])
del warm
before = private_bytes()
source = models.load(_cfg(Path(sys.argv[1])))
TorchLM(source.module).logits([i % 200 + 1 for i in range(128)])
print(private_bytes() - before, source.info["parameters"])
"""


def _sized_folder(out: Path) -> Path:
    """A Llama of about 34M parameters in bf16 (68 MB; 136 MB in FP32), sharded."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.support.models import train_tokenizer

    vocab = train_tokenizer(out)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="30MB")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bf16 folder", "Q8_0 GGUF"])
def test_the_baseline_holds_no_private_fp32_copy_of_the_weights(tmp_path, kind):
    """The weights are file pages (memory-mapped): loading and scoring the baseline adds far less
    private memory than an FP32 copy (4 bytes a parameter) would."""
    import os
    import subprocess
    import sys

    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    source, warm = _sized_folder(tmp_path / "model"), tiny_llama_folder(tmp_path / "warm")
    if kind == "Q8_0 GGUF":
        source = write_gguf(source, tmp_path / "model.Q8_0.gguf", "Q8_0")
        warm = write_gguf(warm, tmp_path / "warm.Q8_0.gguf", "Q8_0")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OPTIMIZE_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-c", HOLDER, str(source), str(warm)]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    added, parameters = map(int, run.stdout.split()[-2:])
    assert parameters > 30_000_000
    assert added < 1.5 * parameters, f"{added / 2**20:.0f} MiB private for {parameters / 1e6:.0f}M parameters"


# ---------------------------------------------------------------- the baseline scored once


def test_the_baseline_standard_task_scores_are_scored_once_and_kept_for_the_next_race(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from optimize.compile.race import lm
    from optimize.tasks import lm_harness

    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    items = {"arc_easy": {"sha256": "a" * 64}}
    monkeypatch.setattr(lm_harness, "standard_task_data", lambda names, limit, folder: items)
    scored = []

    def score(runner, tokens, names, folder, label=""):
        scored.append(label)
        return {"arc_easy": [1.0, 0.0, 1.0]}

    monkeypatch.setattr(lm_harness, "standard_task_items", score)
    ctx = SimpleNamespace(scratch=tmp_path / "scratch")
    cfg = SimpleNamespace(standard_tasks=["arc_easy"], standard_limit=3, task_precision="auto")
    first = lm._standard_reference(ctx, cfg, None, "the baseline", "model-and-machine")
    # "the baseline" here is no PyTorch model: scored as its runtime serves (no precision to choose)
    assert first == {"written": {"arc_easy": "a" * 64}, "scores": {"arc_easy": [1.0, 0.0, 1.0]}, "precision": None}
    assert lm._standard_reference(ctx, cfg, None, "the baseline", "model-and-machine") == first
    assert scored == ["baseline"]  # the second race read the cache
    items["arc_easy"] = {"sha256": "b" * 64}  # other items: scored again
    assert lm._standard_reference(ctx, cfg, None, "the baseline", "model-and-machine")["written"] == {
        "arc_easy": "b" * 64
    }
    assert scored == ["baseline", "baseline"]
    cfg.task_precision = "float32"  # another precision setting: scored again, not read from the cache
    lm._standard_reference(ctx, cfg, None, "the baseline", "model-and-machine")
    assert scored == ["baseline"] * 3
    assert lm._standard_reference(ctx, SimpleNamespace(standard_tasks=[]), None, None, "k") is None
