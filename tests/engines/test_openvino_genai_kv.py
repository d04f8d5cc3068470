"""OpenVINO GenAI's KV cache at the precision it serves with, and prompt lookup, on the tiny random
Llama with peaked next-token distributions (tests/engines/test_openvino_genai.py): the block sizes
the server counts against what the engine allocates, scoring that reads a quantized cache back, the
precisions a recipe may not pair, and prompt lookup's greedy output against the plain engine's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("openvino", "openvino_genai", "openvino_tokenizers")),
        reason="needs openvino, openvino-genai and openvino-tokenizers",
    ),
    pytest.mark.slow,  # each test builds or loads an engine
]
# A prompt that holds its continuation: what prompt lookup speeds up.
GROUNDED = "the cat sat on the mat and the dog lay on the rug. " * 4


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory) -> Path:
    from engines.openvino.genai_build import export_stateful_lm
    from tests.engines.test_openvino_genai import varied_llama_folder

    tmp = tmp_path_factory.mktemp("ov_kv")
    return export_stateful_lm(varied_llama_folder(tmp / "src"), tmp / "ov").parent


def _run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy generations of every prompt at once; also each speculative step's accepted tokens."""
    from engines.generation import Sampling

    handles = [engine.add(i, p, Sampling(max_new_tokens=new_tokens)) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    accepted: list[int] = []
    while engine.has_work():
        engine.step()
        for i, h in enumerate(handles):
            new, _ = engine.read(h)
            out[i] += new
            if h.last_accepted is not None:
                accepted.append(h.last_accepted)
    return out, accepted


@pytest.mark.parametrize("kv, group", [("f32", 0), ("f16", 0), ("u8", 0), ("u8", 8), ("u4", 0), ("u4", 8)])
def test_block_bytes_and_tokens_are_the_engines(ov_dir, kv, group):
    """The server's block size in bytes is what the pipeline allocates, and a block holds 32 tokens:
    a 42-token sequence takes 2 of 20 blocks (10% of the cache)."""
    from engines.generation import BatchSettings
    from engines.openvino.genai_batch import CPU_KV_BLOCK_TOKENS, OVGenAIBatchEngine, kv_block_bytes

    config = json.loads((ov_dir / "config.json").read_text())
    block = kv_block_bytes(config, kv, group)
    settings = BatchSettings(max_num_seqs=2, kv_cache_bytes=20 * block)
    engine = OVGenAIBatchEngine(ov_dir, settings, threads=1, kv_cache_precision=kv, kv_cache_group_size=group)
    assert engine.num_blocks == 20 and engine.block_tokens == CPU_KV_BLOCK_TOKENS == 32
    _run(engine, [list(range(1, 41))], 2)
    metrics = engine.pipe.get_metrics()
    assert metrics.kv_cache_size_in_bytes == engine.kv_cache_bytes == 20 * block
    assert metrics.max_cache_usage == pytest.approx(100 * engine.blocks_for(42) / 20) == pytest.approx(10)


def test_u8_keys_by_channel_and_the_capacity_target(ov_dir):
    """u8 keys carry a scale and zero point per channel for each block (a per-token estimate is about
    5% low at head width 64); at SmolLM2's shape a u8 cache holds over 2.5x the 1,024-token sequences
    per GB of an f32 one."""
    from engines.openvino.genai_batch import kv_block_bytes, kv_bytes_per_token

    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_bytes_per_token(smollm2, "u8") == 30 * 3 * (80 + 72)
    assert kv_bytes_per_token(smollm2, "f32") == 30 * 3 * 512
    gb = 2**30
    fits = {kv: (gb // kv_block_bytes(smollm2, kv)) // -(-1025 // 32) for kv in ("f32", "u8")}
    assert fits["u8"] >= 2.5 * fits["f32"]


def test_scoring_reads_a_quantized_kv_cache_back(ov_dir):
    """One pass over a sequence never reads the cache back, so a u8 or u4 cache would score as f32:
    scored in passes, the quantized caches' logits differ from f32's (u4 more), and f32 scored in
    passes is f32 scored in one."""
    from engines.openvino.genai_runner import SCORING_CHUNK_TOKENS, OVGenAIRunner

    ids = [int(i) for i in np.random.RandomState(0).randint(1, 500, size=4 * SCORING_CHUNK_TOKENS)]
    base = OVGenAIRunner(ov_dir, threads=1).logits(ids)
    drift = {}
    for kv in ("u8", "u4"):
        logits = OVGenAIRunner(ov_dir, threads=1, kv_cache_precision=kv).logits(ids)
        assert logits.shape == base.shape
        # the first pass reads no cache: the same logits as f32
        np.testing.assert_allclose(logits[:SCORING_CHUNK_TOKENS], base[:SCORING_CHUNK_TOKENS], atol=1e-4)
        drift[kv] = float(np.abs(logits - base).max())
    assert 1e-3 < drift["u8"] < drift["u4"]


def test_precision_pairings_the_plugin_refuses_are_one_line(ov_dir):
    from engines.openvino.genai_runner import resolve_kv_precision, runner_properties

    assert resolve_kv_precision("f32", None) == "f32" and resolve_kv_precision("bf16", "u8") == "u8"
    for inference, kv in (("f32", "bf16"), ("bf16", "f32"), ("f32", "i8")):
        with pytest.raises(ValueError, match="kv_cache_precision"):
            resolve_kv_precision(inference, kv)
    props = runner_properties(1, "f32", "u4", True, 32)
    assert props["KEY_CACHE_GROUP_SIZE"] == props["VALUE_CACHE_GROUP_SIZE"] == 32


def test_prompt_lookup_greedy_output_is_the_plain_engines(ov_dir):
    """Several requests at once, greedy: the prompt-lookup pipeline's tokens are the plain one's, and
    on prompts that repeat themselves its decode steps accept proposed tokens."""
    from engines.generation import BatchSettings
    from engines.openvino.genai_batch import OVGenAIBatchEngine

    plain = OVGenAIBatchEngine(ov_dir, BatchSettings(max_num_seqs=4, kv_cache_bytes=1 << 22), threads=1)
    lookup = OVGenAIBatchEngine(
        ov_dir, BatchSettings(max_num_seqs=4, kv_cache_bytes=1 << 22, prompt_lookup=True), threads=1
    )
    assert lookup.proposed_per_step == 5 and "prompt lookup 5 tokens" in lookup.describe()
    prompts = [plain.encode(GROUNDED), plain.encode("def main():\n    return 1\n" * 3), plain.encode("A class")]
    expected, none = _run(plain, prompts, 24)
    got, accepted = _run(lookup, prompts, 24)
    assert got == expected and none == []
    assert accepted and all(0 <= a <= 5 for a in accepted)


def test_prompt_lookup_runner_matches_the_plain_runner(ov_dir):
    """The one-at-a-time runner (what the race times) with prompt lookup: the same greedy tokens."""
    from engines.generation import Sampling
    from engines.openvino.genai_runner import OVGenAIRunner

    plain = OVGenAIRunner(ov_dir, threads=1)
    lookup = OVGenAIRunner(ov_dir, threads=1, prompt_lookup={"num_assistant_tokens": 3})
    assert lookup.prompt_lookup == {"num_assistant_tokens": 3, "max_ngram_size": 3}
    ids = plain.encode(GROUNDED)
    run = [t for t, _ in plain.generate(ids, Sampling(max_new_tokens=20))]
    assert [t for t, _ in lookup.generate(ids, Sampling(max_new_tokens=20))] == run
    # scoring is the same IR either way
    np.testing.assert_allclose(lookup.logits(ids[:20]), plain.logits(ids[:20]), atol=1e-5)


def test_recipe_kv_settings_are_checked_before_any_build():
    """engine.params: a pairing the plugin refuses, or a negative group, is a RecipeError naming the key;
    what the engine block records is what scoring and serve load."""
    from optimize.compile.openvino_genai import OVGenAIConfig
    from optimize.errors import RecipeError

    for params in ({"kv_cache_precision": "bf16"}, {"kv_cache_precision": "q8"}, {"kv_cache_group_size": -1}):
        with pytest.raises(RecipeError, match="engine.params.kv_cache"):
            OVGenAIConfig(weight_format="fp32", **params).validate()
    assert OVGenAIConfig().serving() == {"kv_cache_precision": "f32"}
    cfg = OVGenAIConfig(kv_cache_precision="u4", kv_cache_group_size=32, prompt_lookup=True, num_assistant_tokens=4)
    assert cfg.serving() == {
        "kv_cache_precision": "u4",
        "kv_cache_group_size": 32,
        "prompt_lookup": {"num_assistant_tokens": 4, "max_ngram_size": 3},
    }


def test_prompt_lookup_on_compressed_weights_keeps_activations_f32_and_its_greedy_output(ov_dir, tmp_path):
    """On compressed weights the CPU plugin quantizes activations to INT8 by default, and a verification
    pass quantizes several tokens where plain decoding quantizes one: prompt lookup's IR records f32
    activations (0), every runner reads it from the IR, and its greedy tokens stay the plain ones."""
    import shutil

    import openvino as ov

    from engines.generation import BatchSettings
    from engines.openvino.genai_batch import OVGenAIBatchEngine
    from engines.openvino.genai_build import IR_FILE, rewrite_activation_quantization
    from engines.openvino.genai_compress import compress_weights
    from optimize.compile.openvino_genai import OVGenAIConfig
    from optimize.errors import RecipeError

    assert OVGenAIConfig().activation_groups is None  # the plugin's default
    assert OVGenAIConfig(prompt_lookup=True).activation_groups == 0
    assert OVGenAIConfig(prompt_lookup=True, dynamic_quantization_group_size=32).activation_groups == 32
    with pytest.raises(RecipeError, match="engine.params.dynamic_quantization_group_size=-1"):
        OVGenAIConfig(weight_format="fp32", dynamic_quantization_group_size=-1).validate()
    with pytest.raises(RecipeError, match="dynamic_quantization_group_size=1000000000000000000000000000000"):
        OVGenAIConfig(weight_format="fp32", dynamic_quantization_group_size=10**30).validate()

    int8 = compress_weights(ov_dir / IR_FILE, tmp_path / "int8", mode="int8_asym").parent
    for path in ov_dir.iterdir():  # tokenizer and configs beside the compressed IR
        if not (int8 / path.name).exists():
            shutil.copy2(path, int8 / path.name)
    rewrite_activation_quantization(int8 / IR_FILE, 0)
    options = ov.Core().read_model(str(int8 / IR_FILE)).get_rt_info()["runtime_options"]
    assert options["DYNAMIC_QUANTIZATION_GROUP_SIZE"].astype(str) == "0"
    assert sorted(p.name for p in int8.iterdir() if p.name.startswith(".")) == []  # nothing staged is left

    settings = BatchSettings(max_num_seqs=4, kv_cache_bytes=1 << 22)
    plain = OVGenAIBatchEngine(int8, settings, threads=1, kv_cache_precision="u8")
    lookup = OVGenAIBatchEngine(
        int8,
        BatchSettings(max_num_seqs=4, kv_cache_bytes=1 << 22, prompt_lookup=True),
        threads=1,
        kv_cache_precision="u8",
    )
    prompts = [plain.encode(GROUNDED), plain.encode("def main():\n    return 1\n" * 3)]
    expected, _ = _run(plain, prompts, 24)
    got, accepted = _run(lookup, prompts, 24)
    assert got == expected and accepted


@pytest.mark.parametrize("kv", ["f32", "u8"])
def test_shared_context_scoring_equals_scoring_each_choice_whole(ov_dir, kv):
    """The choices of a multiple-choice item scored from one pass over their shared context (its KV
    cache gathered into every row by beam_idx) give what scoring each context + choice whole gives;
    over a u8 cache the passes start at other positions, so the two read the cache back a little
    differently."""
    from engines.openvino.genai_runner import SCORING_CHUNK_TOKENS, OVGenAIRunner

    runner = OVGenAIRunner(ov_dir, threads=1, kv_cache_precision=kv)
    context = [int(i) for i in np.random.RandomState(1).randint(1, 500, size=SCORING_CHUNK_TOKENS + 5)]
    choices = [[7, 9], [12, 4, 44, 7, 1] * 4, [60]]
    for choice, logprobs in zip(choices, runner.continuation_logprobs(context, choices)):
        whole = runner.log_likelihood(context + choice, start=len(context))
        assert logprobs.shape == (len(choice),)
        np.testing.assert_allclose(logprobs, whole, atol=1e-4 if kv == "f32" else 0.05)
    np.testing.assert_allclose(runner.logits(context), runner.logits(context))  # the state is reset after
