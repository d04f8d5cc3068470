"""Causal-LM path on a tiny random Llama (2 layers, width 64, a BPE tokenizer trained on CPython docs):
GenAI engine, scoring and timing harness, modelopt methods, gate checks, recipes. The real SmolLM2
recipe runs in test_causal_lm_smollm2.py (minutes on its own: a file of its own runs beside this one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import ROOT, one_error_line, refusal_in_process, run_optimize
from tests.support.context import recipe_context
from tests.support.models import tiny_llama_folder


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llm") / "src")


@pytest.fixture(scope="module")
def tiny_torch(tiny_llm):
    from transformers import AutoModelForCausalLM

    from engines.pytorch.runner import TorchLM

    return TorchLM(AutoModelForCausalLM.from_pretrained(str(tiny_llm), attn_implementation="sdpa"))


@pytest.fixture(scope="module")
def tiny_genai_fp32(tiny_llm, tmp_path_factory):
    from engines.onnxruntime_genai.build import build
    from engines.onnxruntime_genai.runner import GenAIRunner

    out = tmp_path_factory.mktemp("genai") / "fp32"
    build(tiny_llm, out, "fp32", "cpu", [], out.parent / "cache")
    return GenAIRunner(out)


# The ONNX Runtime GenAI engine alone, k_quant_mixed as the race's ORT candidate builds it.
TINY_OVERRIDES = [
    "recipe=smollm2_int4_cpu",
    "engine=genai_int4",
    "engine.params.algo_config=k_quant_mixed",
    "model.max_length=128",
    "gate.max_ppl_increase_pct=1000",
    # No speed threshold: a timed check is "untrusted" whenever another process shares the machine.
    "gate.min_decode_speedup=null",
    "evaluate.data.count=8",
    "evaluate.warmup=1",
    "evaluate.retimes=0",  # no speed gated; the other test worker shares the machine
    "evaluate.repeats=3",
    "calibration.count=4",
    "evaluate.task_params.perplexity_tokens=256",
    "evaluate.task_params.perplexity_window=128",
    "evaluate.task_params.prompt_tokens=16",
    "evaluate.task_params.new_tokens=8",
    "evaluate.task_params.lm_eval_tasks=[cpython_next_sentence]",
    "evaluate.task_params.lm_eval_limit=4",
    # Fidelity and a standard task at a size a tiny model scores in seconds; the recipe's thresholds on
    # them are for SmolLM2 (a random model's KLD to its INT4 copy is not), so they are not checked.
    "evaluate.task_params.fidelity_tokens=512",
    "++evaluate.task_params.fidelity_window=128",  # not in the recipe: it follows perplexity_window
    "evaluate.task_params.fidelity_screen_tokens=128",
    "evaluate.task_params.standard_tasks=[arc_easy]",
    "evaluate.task_params.standard_limit=4",
    "gate.max_mean_kld=null",
    "gate.min_top1_agreement=null",
    "gate.max_task_drop_pts=null",
    "workload.requests=null",  # one request of prompt_tokens and new_tokens, as before workloads
]


def test_genai_int4_recipe_on_tiny_model(tiny_llm, tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={tiny_llm}", *TINY_OVERRIDES, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"]["format"] == "onnxruntime-genai"
    assert (out / manifest["engine"]["dir"] / "genai_config.json").is_file()
    base, cand = manifest["metrics"]["baseline"], manifest["metrics"]["candidate"]
    assert base["perplexity"] > 1 and cand["perplexity"] > 1
    assert cand["decode_speedup"] > 0 and cand["generation"]["runs"] == 3
    assert "cpython_next_sentence" in cand["lm_eval"]
    assert cand["fidelity"]["tokens"] == 2 * (256 - 2) and 0 <= cand["fidelity"]["top1_agreement"] <= 1
    assert cand["fidelity"]["mean_kld"] > 0  # INT4 weights change the distributions
    arc = cand["standard_tasks"]["tasks"]["arc_easy"]
    assert arc["items"] == 4 and arc["lost"] + arc["gained"] <= 4
    assert "mean KLD vs baseline (nats)" in proc.stdout and "arc_easy (4 items)" in proc.stdout
    layers = manifest["stages"]["engine"]["layer_precision"]
    # k_quant_mixed: every projection (fused qkv, o, gate, up, down) of both layers and the LM head is
    # quantized, the sensitive ones at 8 bits
    assert layers["int4"]["count"] + layers["int8"]["count"] >= 2 * 5 + 1
    assert "weights kept at int4" in proc.stdout
    # The recipe's two perplexity bars: over the baseline and over the source (here the same model).
    assert {c["name"] for c in manifest["gate"]["checks"]} == {
        "max_ppl_increase_pct",
        "max_ppl_increase_over_source_pct",
    }
    assert "perplexity (held-out)" in proc.stdout and "decode tok/s p50" in proc.stdout
    # Memory planned from the safetensors headers before loading, and each stage's time and peak as run.
    resources = manifest["resources"]
    assert resources["memory_plan"]["parameters"] == manifest["model"]["parameters"]
    stages = {row["stage"]: row for row in resources["stages"]}
    assert {"load", "baseline", "engine: onnxruntime_genai", "evaluate"} <= set(stages)
    assert all(row["peak_gb"] > 0 and row["seconds"] >= 0 for row in stages.values())
    assert "where the time went" in proc.stdout + proc.stderr
    # What the trusted gate's measures cost, each side's part a stage of its own and summed in the headline.
    measures = ["the baseline's fidelity reference", "the candidate's fidelity"]
    measures += ["the baseline's standard tasks", "the candidate's standard tasks"]
    assert {f"evaluation: {name}" for name in measures} <= set(stages)
    assert "the fidelity and task measures took" in proc.stdout + proc.stderr
    from engines import load

    assert load(out).generate  # the artifact loads back through the engine dispatch


def test_genai_scores_match_pytorch(tiny_torch, tiny_genai_fp32):
    ids = tiny_genai_fp32.encode("The return statement leaves the current function call.")
    torch_lp = tiny_torch.log_likelihood(ids, start=3)
    genai_lp = tiny_genai_fp32.log_likelihood(ids, start=3)
    assert len(genai_lp) == len(ids) - 3
    np.testing.assert_allclose(genai_lp, torch_lp, atol=2e-3)
    out = tiny_genai_fp32({"input_ids": np.array([ids])})
    assert out["logits"].shape == (1, len(ids), tiny_torch.logits(ids).shape[-1])


def test_timed_stream_and_greedy_agree(tiny_torch, tiny_genai_fp32):
    from engines.generation import greedy_ids

    prompt = tiny_genai_fp32.encode("A class definition")
    assert len(tiny_genai_fp32.timed_stream(prompt, 6)) == 6
    assert len(tiny_torch.timed_stream(prompt, 6)) == 6
    assert greedy_ids(tiny_torch, prompt, 5)[:3] == greedy_ids(tiny_genai_fp32, prompt, 5)[:3]


def test_speed_harness_reports_percentiles(tiny_torch, tiny_genai_fp32):
    from optimize.evaluate.generation import speed

    prompts = [tiny_genai_fp32.encode("while loops repeat")]
    result = speed({"baseline": tiny_torch, "candidate": tiny_genai_fp32}, prompts, 5, warmup=1, runs=3)
    for side in ("baseline", "candidate"):
        stats = result[side]
        assert stats["runs"] == 3 and stats["new_tokens"] == 5
        assert stats["decode_tok_s"]["p95"] <= stats["decode_tok_s"]["p50"]  # p95 is the slow tail
        assert stats["ttft_ms"]["p50"] <= stats["ttft_ms"]["p95"]


def test_a_timing_budget_stops_the_timed_runs_it_has_spent_but_keeps_a_median(monkeypatch):
    from optimize.evaluate import generation

    clock = {"now": 0.0}
    monkeypatch.setattr(generation.time, "perf_counter", lambda: clock["now"])

    class Slow:  # 10 s a generation of the clock above, one token a second after the first
        def timed_stream(self, prompt, new_tokens):
            clock["now"] += 10.0
            return [clock["now"] - new_tokens + 1 + i for i in range(new_tokens)]

    slow = {"baseline": Slow()}
    kept = generation.speed(slow, [[1, 2, 3]], 4, warmup=1, runs=5, budget_s=25.0)
    assert kept["baseline"]["runs"] == 2  # each run is 20 s with its settling pass: two spend the budget
    assert kept["baseline"]["decode_tok_s"]["p50"] == pytest.approx(1.0)
    assert generation.speed(slow, [[1, 2, 3]], 4, warmup=1, runs=5, budget_s=1.0)["baseline"]["runs"] == 2
    assert generation.speed(slow, [[1, 2, 3]], 4, warmup=1, runs=5)["baseline"]["runs"] == 5  # no budget


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    from optimize.evaluate.generation import perplexity

    class Uniform:
        def log_likelihood(self, ids, start=1):
            return np.full(len(ids) - start, -np.log(100.0))

    assert perplexity(Uniform(), list(range(300)), 64) == pytest.approx(100.0)


def test_local_lm_eval_task_is_well_formed(tmp_path):
    import calibration
    from optimize.tasks.lm_harness import LOCAL_TASK, next_sentence_items, write_local_task

    paragraphs = calibration.load("cpython_docs", "evaluation", 40, 1).items
    items = next_sentence_items(paragraphs, 10)
    assert len(items) == 10
    for item in items:
        assert len(item["choices"]) == 4 and 0 <= item["label"] < 4
    data = write_local_task(items, tmp_path)
    assert (tmp_path / f"{LOCAL_TASK}.yaml").read_text().count(str(data)) == 1
    assert next_sentence_items(paragraphs, 10) == items  # seeded: the same questions every run


def test_shared_context_scoring_equals_scoring_each_choice_whole(tiny_torch):
    """A multiple-choice item's choices scored from one pass over their shared question (the PyTorch
    baseline's continuation_logprobs, choices of different lengths in one padded batch) give what
    scoring each question + choice whole gives; a runner without it is scored pair by pair."""
    from optimize.tasks.lm_harness import continuation_sums

    context = list(range(3, 40, 3))
    choices = [[5, 9], [12, 4, 44, 7, 1], [60]]
    shared = tiny_torch.continuation_logprobs(context, choices)
    for choice, logprobs in zip(choices, shared):
        whole = tiny_torch.log_likelihood(context + choice, start=len(context))
        assert logprobs.shape == (len(choice),)
        np.testing.assert_allclose(logprobs, whole, atol=1e-4)

    class PairByPair:  # what the other runners offer
        log_likelihood = staticmethod(tiny_torch.log_likelihood)

    pairs = [(context, c) for c in choices] + [(context[:5], [8, 8])]
    np.testing.assert_allclose(continuation_sums(tiny_torch, pairs), continuation_sums(PairByPair(), pairs), atol=1e-4)
    with pytest.raises(ValueError, match="non-empty"):
        tiny_torch.continuation_logprobs(context, [[1], []])


def test_lm_eval_adapter_scores_continuations(tiny_torch, tiny_genai_fp32, tmp_path):
    pytest.importorskip("lm_eval")
    from optimize.tasks.causal_lm import LLMEvalConfig
    from optimize.tasks.lm_harness import lm_eval_scores as _lm_eval_metrics

    class Tokens:
        encode = tiny_genai_fp32.encode

        def __call__(self, text):
            return self.encode(text)

        def decode(self, ids):
            return tiny_genai_fp32.decode(ids)

    import calibration

    metrics = {"baseline": {}, "candidate": {}}
    paragraphs = calibration.load("cpython_docs", "evaluation", 40, 1).items
    info = _lm_eval_metrics(
        metrics, tiny_torch, tiny_genai_fp32, Tokens(), paragraphs, LLMEvalConfig(lm_eval_limit=6), tmp_path
    )
    assert info["local_items"] == 6
    assert 0 <= metrics["candidate"]["lm_eval"]["cpython_next_sentence"] <= 1
    # FP32 GenAI and PyTorch score the same choices, so they agree on every answer
    assert metrics["candidate"]["lm_eval_drop_pts"] == pytest.approx(0.0, abs=1e-9)


def test_gate_reads_llm_metrics():
    from optimize import gate

    cand = {"perplexity_increase_pct": 12.0, "decode_speedup": 3.5, "lm_eval_drop_pts": 1.0}
    verdict = gate.judge({}, cand, {"max_ppl_increase_pct": 15, "min_decode_speedup": 4, "max_lm_eval_drop": 2})
    results = {c.name: c.passed for c in verdict.checks}
    assert results == {"max_ppl_increase_pct": True, "min_decode_speedup": False, "max_lm_eval_drop": True}
    missing = gate.judge({}, {}, {"min_decode_speedup": 4})
    assert not missing.passed and missing.checks[0].note == "not measured"


def test_builder_options_and_bad_params():
    from optimize.errors import RecipeError
    from optimize.registry import build_config, get

    method = get("engine", "onnxruntime_genai")
    cfg = build_config(method, {"algo_config": "k_quant_last", "is_symmetric": False, "accuracy_level": 4})
    assert {"algo_config=k_quant_last", "is_symmetric=false", "accuracy_level=4", "block_size=32"} <= set(
        cfg.builder_options()
    )
    with pytest.raises(RecipeError, match="algo_config"):
        build_config(method, {"algo_config": "gptq"})
    with pytest.raises(RecipeError, match="not a parameter"):
        build_config(method, {"int4_block": 32})


def test_nvfp4_and_gpu_recipe_refused_without_cuda(tmp_path):
    from optimize.quantize.modelopt import cuda_missing

    if cuda_missing() is None:
        pytest.skip("CUDA is present")
    from optimize.errors import RecipeError
    from optimize.registry import build_config, get

    with pytest.raises(RecipeError, match="needs CUDA"):
        build_config(get("quantize", "modelopt_nvfp4"), {})
    proc = refusal_in_process(
        "recipe=smollm2_fp8_gpu", f"output_dir={tmp_path / 'a'}", f"hydra.run.dir={tmp_path / 'r'}"
    )
    one_error_line(proc, "CUDA")
    assert not (tmp_path / "a").exists()


def test_llm_recipes_compose():
    from hydra import compose, initialize_config_dir

    from optimize.config import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base=None):
        for name in ("smollm2_int4_cpu", "smollm2_fp8_sim", "smollm2_fp8_gpu"):
            cfg = compose("config", overrides=[f"recipe={name}"])
            assert cfg.model.task == "causal_lm"
        assert compose("config", overrides=["recipe=smollm2_fp8_sim"]).evaluate.latency is False


@pytest.mark.parametrize(
    "name", ["modelopt_fp8", "modelopt_int8_smoothquant", "modelopt_int4_awq", "modelopt_w4a8_awq"]
)
def test_modelopt_methods_on_tiny_model(name, tiny_llm, tiny_torch, tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    from engines.pytorch.modelopt_runner import load_modelopt_runner
    from engines.pytorch.runner import TorchLM
    from optimize.compile.modelopt_checkpoint import CheckpointConfig, modelopt_checkpoint
    from optimize.context import Model
    from optimize.registry import build_config, get

    method = get("quantize", name)
    from engines.text import TextEncoder

    ctx = recipe_context(tmp_path, "calibration=cpython_docs", "calibration.count=4", encoder=TextEncoder(tiny_llm))
    source = Model("torch", "causal_lm", module=tiny_torch.model)
    quantized = method.fn(source, build_config(method, {"calibration_samples": 2, "max_tokens": 32}), ctx)
    assert quantized.module is not tiny_torch.model  # the baseline module is left untouched
    layers = quantized.record["layer_precision"]
    assert layers["quantized"]["count"] == 2 * 7  # q, k, v, o, gate, up, down in both layers
    ids = list(range(1, 40))
    simulated = TorchLM(quantized.module).log_likelihood(ids)
    assert np.isfinite(simulated).all()
    assert not np.allclose(simulated, tiny_torch.log_likelihood(ids))  # the numerics really changed
    engine_model = modelopt_checkpoint(quantized, CheckpointConfig(export_hf=False), ctx)
    reloaded = load_modelopt_runner(engine_model.engine_dir, engine_model.engine)
    np.testing.assert_allclose(reloaded.log_likelihood(ids), simulated, atol=1e-4)


def test_a_long_prompt_shape_is_timed_and_one_that_does_not_fit_the_context_is_refused(tiny_llm, tmp_path):
    base = [o for o in TINY_OVERRIDES if not o.startswith("workload.")] + [
        "evaluate.task_params.lm_eval_tasks=[]",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={tiny_llm}",
        *base,
        "workload.requests=[{prompt:16,output:8,weight:3},{prompt:300,output:8}]",
        "gate.min_decode_speedup=0.0001",
        "gate.request_shape=all",
        f"output_dir={out}",
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    cand = manifest["metrics"]["candidate"]
    assert set(cand["requests"]) == {"16x8", "300x8"}
    assert cand["requests"]["300x8"]["generation"]["prompt_tokens"] == 300  # cut from the joined text
    assert cand["generation"] == cand["requests"]["16x8"]["generation"]  # the first shape is the headline
    assert [c["name"] for c in manifest["gate"]["checks"] if "decode" in c["name"]] == [
        "min_decode_speedup[shape=16x8]",
        "min_decode_speedup[shape=300x8]",
    ]
    assert manifest["metrics"]["workload"]["requests"][0]["weight"] == 0.75
    assert "request time p50 ms (300x8)" in proc.stdout and "decode tok/s p50 (300x8)" in proc.stdout

    refused = tmp_path / "refused"
    proc = run_optimize(
        f"model.source={tiny_llm}", *base, "workload.requests=[{prompt:1024,output:128}]", f"output_dir={refused}"
    )
    one_error_line(proc, "workload.requests: 1024 prompt + 128 output tokens do not fit the model's context of 512")
    assert not refused.exists()
