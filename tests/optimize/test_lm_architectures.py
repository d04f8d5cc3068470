"""Causal LMs of the architectures people bring (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3):
tiny random models built from each config (2 layers, hidden 64), written as a Hugging Face folder and
as GGUF files (F32, Q8_0, Q4_K), through every LM engine: ONNX Runtime GenAI's builder, the OpenVINO
GenAI export, PyTorch. Each engine's FP32 build must score the same log-likelihoods as transformers;
what an engine cannot take is refused in one line before anything is built; a GGUF file of an
architecture transformers does not read exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import TINY_LM_RACE, one_error_line, refusal_in_process, run_optimize
from tests.support.tiny_archs import ARCHITECTURES

pytest.importorskip("gguf")

TEXT = "The return statement leaves the current function call with the expression list. " * 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """arch -> its tiny Hugging Face folder (built on first use)."""
    from tests.support.tiny_archs import tiny_folder

    root, made = tmp_path_factory.mktemp("archs"), {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = tiny_folder(arch, root / arch)
        return made[arch]

    return get


def _ids(folder: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids


def _torch(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    from engines.pytorch.runner import TorchLM

    return TorchLM(AutoModelForCausalLM.from_pretrained(str(folder), **kwargs))


# ONNX Runtime GenAI 0.18 (onnxruntime 1.32) FP32 builds score differently from transformers, from the
# first token on, for head size 128 or more (any architecture: Llama with head_dim 128 or 256 too, while
# 16-96 agree) and for Phi-3 at any head size (max |log p difference| 0.2-1.2 on these tiny models).
# The race still builds them and its perplexity check judges what they score; strict, so a fixed
# builder shows here.
GENAI_DISAGREES = {
    "qwen3": "head size 128 (Qwen3's, which its GGUF files imply)",
    "phi3": "Phi-3's graph, at every head size tried",
}


# Llama's FP32 build is checked in test_causal_lm.py (test_genai_scores_match_pytorch); the builds that
# disagree are slow-marked, so the default run spends its builder minutes on the ones that hold.
@pytest.mark.parametrize(
    "arch",
    [
        pytest.param(a, marks=[pytest.mark.slow, pytest.mark.xfail(strict=True, reason=GENAI_DISAGREES[a])])
        if a in GENAI_DISAGREES
        else a
        for a in ARCHITECTURES
        if a != "llama"
    ],
)
def test_genai_fp32_scores_like_transformers(arch, folders, tmp_path):
    """The builder's FP32 graph against transformers on a prompt longer than the sliding window (32):
    rope settings, windows, tied embeddings, q/k norms and Gemma's 1 + w norms all show in the scores."""
    from transformers import AutoConfig

    from engines import lm_archs
    from engines.onnxruntime_genai.build import build
    from engines.onnxruntime_genai.runner import GenAIRunner

    folder = folders(arch)
    ids = _ids(folder)
    assert len(ids) > 40  # past the window of the sliding layers
    assert lm_archs.refusal("onnxruntime_genai", AutoConfig.from_pretrained(str(folder))) is None
    build(folder, tmp_path / "genai", "fp32", "cpu", [], tmp_path / "cache")
    scores = GenAIRunner(tmp_path / "genai").log_likelihood(ids)
    np.testing.assert_allclose(scores, _torch(folder).log_likelihood(ids), atol=2e-3)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_openvino_genai_fp32_scores_like_transformers(arch, folders, tmp_path):
    """The stateful IR (its sliding-window masks built per layer kind) against transformers."""
    from transformers import AutoConfig

    from engines import lm_archs
    from engines.openvino.genai_build import export_stateful_lm
    from engines.openvino.genai_runner import OVGenAIRunner

    folder = folders(arch)
    ids = _ids(folder)
    assert lm_archs.refusal("openvino_genai", AutoConfig.from_pretrained(str(folder))) is None
    export_stateful_lm(folder, tmp_path / "ov")
    runner = OVGenAIRunner(tmp_path / "ov", inference_precision="f32", kv_cache_precision="f32")
    np.testing.assert_allclose(runner.log_likelihood(ids), _torch(folder).log_likelihood(ids), atol=2e-3)


# Q8_0 (the gguf package quantizes it) and Q4_K (written here: gguf only dequantizes K-quants).
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_gguf_files_load_as_the_model_they_came_from(arch, qtype, folders, tmp_path, monkeypatch):
    """The pipeline's loader dequantizes the GGUF file to the architecture it was written from, with the
    tokenizer and chat template the file carries, and the folder the builders read keeps them."""
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))  # the converted folder goes there
    import torch
    from omegaconf import OmegaConf

    from optimize.sources import models
    from tests.support.gguf_writer import write_gguf

    folder = folders(arch)
    gguf_path = write_gguf(folder, tmp_path / f"{arch}.{qtype}.gguf", qtype)
    cfg = OmegaConf.create(
        {
            "source": str(gguf_path),
            "task": "causal_lm",
            "max_length": 128,
            "allow_pickle": False,
            "trust_remote_code": False,
            "revision": None,
            "gguf_file": None,
            "tokenizer": None,
        }
    )
    source = models.load(cfg)
    reference = _torch(folder).model
    assert source.module.config.model_type == reference.config.model_type or arch == "mistral"  # llama.cpp: llama
    # Within the sliding window (32): llama.cpp writes a Mistral as a Llama, without its window, so
    # transformers reads it back with full attention (the same model on prompts the window holds).
    ids = torch.tensor([_ids(folder)[:32]])
    with torch.no_grad():
        diff = (source.module(ids).logits - reference(ids).logits).abs().max().item()
    assert diff < (0.05 if qtype == "Q8_0" else 0.25), diff  # quantization error, not a layout error
    converted = models.hf_folder(source)
    assert (converted / "model.safetensors").is_file()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    assert tokenizer.chat_template and "<|assistant|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_the_architecture_table_refuses_in_one_line():
    from transformers import GPT2Config, MambaConfig

    from engines import lm_archs

    gpt2 = GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"])
    assert lm_archs.refusal("onnxruntime_genai", gpt2) == (
        "ONNX Runtime GenAI's builder has no graph for gpt2 (GPT2LMHeadModel)"
    )
    mamba = MambaConfig(num_hidden_layers=1, hidden_size=16, architectures=["MambaForCausalLM"])
    assert "keeps other state" in lm_archs.refusal("openvino_genai", mamba)
    assert lm_archs.refusal("pytorch", mamba) is None  # PyTorch runs whatever transformers loads


def test_builder_config_writes_what_the_genai_builder_reads():
    """Transformers 5 nests Gemma 3's rope per layer type; the builder reads a flat rope_type and
    rope_local_base_freq (the reported KeyError: 'rope_type'), and Mistral's window per layer."""
    from engines.onnxruntime_genai.build import builder_config
    from tests.support.tiny_archs import tiny_config

    gemma3 = builder_config(tiny_config("gemma3", 512))
    assert gemma3.rope_parameters["rope_type"] == "default"
    assert gemma3.rope_parameters["rope_theta"] == 1_000_000.0 and gemma3.rope_local_base_freq == 10_000.0
    mistral = builder_config(tiny_config("mistral", 512))
    assert mistral.layer_types == ["sliding_attention", "sliding_attention"]
    phi3 = builder_config(tiny_config("phi3", 512))
    assert phi3.original_max_position_embeddings == phi3.max_position_embeddings  # not LongRoPE


def _race(gguf_path: Path, tmp_path: Path, *overrides: str):
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={gguf_path}",
        *TINY_LM_RACE,
        *overrides,
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "manifest.json").read_text())


def test_a_gemma3_q4_k_gguf_goes_through_every_lm_candidate(folders, tmp_path):
    """The reported case, in small: a Gemma 3 GGUF file (K-quant) through the shipped recipe with only
    model.source changed; ONNX Runtime GenAI and OpenVINO GenAI candidates both built and scored."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("openvino_genai")
    from tests.support.gguf_writer import write_gguf

    gguf_path = write_gguf(folders("gemma3"), tmp_path / "gemma3.Q4_K.gguf", "Q4_K")
    proc, manifest = _race(
        gguf_path, tmp_path, "engine.params.candidates=[ort_genai_int4_k_quant_mixed,openvino_genai_int4_g32]"
    )
    race = manifest["stages"]["engine"]
    for candidate in race["candidates"]:
        assert candidate["metrics"]["perplexity"] > 0, candidate["outcome"]
        assert candidate["build_s"] > 0 or candidate["cached"]
    # every candidate built; successive halving may still cut one on timing alone (its own NOTE line)
    notes = [line for line in proc.stdout.splitlines() if "NOTE:" in line and "successive halving" not in line]
    assert race["fewer_than_asked"] is None and not notes, notes
    assert set(race["budget"]["build_s"]) == {"ort_genai_int4_k_quant_mixed", "openvino_genai_int4_g32"}
    assert "build s" in proc.stdout


def test_a_gguf_of_an_unsupported_architecture_exits_2_with_one_line(folders, tmp_path):
    from tests.support.gguf_writer import write_gguf

    gguf_path = write_gguf(folders("qwen2"), tmp_path / "rwkv.gguf", "Q8_0", architecture="rwkv6")
    out = tmp_path / "artifact"
    proc = refusal_in_process(
        f"model.source={gguf_path}", "recipe=smollm2_int4_cpu", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'r'}"
    )
    one_error_line(proc, "GGUF architecture 'rwkv6' is not a causal LM that transformers")
    assert not out.exists()


def test_the_race_refuses_at_plan_time_what_an_engine_cannot_take():
    from types import SimpleNamespace

    from transformers import MambaConfig

    from optimize.compile.race import budget
    from optimize.compile.race.candidates import CANDIDATES
    from optimize.compile.race.entry import Entry

    mamba = MambaConfig(num_hidden_layers=1, hidden_size=16, architectures=["MambaForCausalLM"])
    entries = [Entry(n, CANDIDATES[n]) for n in ("ort_genai_int4", "openvino_genai_int8")]
    budget.refuse_at_plan_time(entries, SimpleNamespace(module=SimpleNamespace(config=mamba)))
    assert all(e.refused for e in entries)
    assert entries[0].outcome == (
        "refused at plan time: ONNX Runtime GenAI's builder has no graph for mamba (MambaForCausalLM)"
    )
    assert budget.fewer_than_asked(entries).endswith("(refused at plan time: ort_genai_int4, openvino_genai_int8)")
