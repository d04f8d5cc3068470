"""OpenVINO GenAI engine for causal LMs on a tiny random Llama (2 layers, width 64, a BPE tokenizer
trained on CPython docs): the stateful export against the Hugging Face model (one pass, and step by
step through the KV cache), LLMPipeline generation, NNCF INT4, the engine method through the real
command line, and the artifact served over the OpenAI protocol."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import one_error_line, run_optimize
from tests.support.models import tiny_llama_folder

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("openvino", "openvino_genai", "openvino_tokenizers", "nncf")),
    reason="needs openvino, openvino-genai, openvino-tokenizers and nncf",
)

# The smollm2_int4_cpu recipe's settings composed without the recipe (its engine.params name
# onnxruntime_genai options), at tiny-model sizes; the speed gate is lenient (a shared 2-core
# machine may still fail it as untrusted, exit 1, which these tests accept).
TINY_OV_OVERRIDES = [
    "~recipe",
    "model=smollm2",
    "quantize=none",
    "engine=openvino_genai_int4",
    "gate=llm_int4_cpu",
    "evaluate.batch_sizes=[1]",
    "evaluate.memory=false",
    "model.max_length=128",
    "gate.max_ppl_increase_pct=1000",
    "gate.min_decode_speedup=0.01",
    "evaluate.data.count=8",
    "evaluate.warmup=1",
    "evaluate.retimes=0",  # no speed gated; the other test worker shares the machine
    "evaluate.repeats=3",
    "calibration.count=4",
    "+evaluate.task_params.perplexity_tokens=256",
    "+evaluate.task_params.perplexity_window=128",
    "+evaluate.task_params.prompt_tokens=16",
    "+evaluate.task_params.new_tokens=8",
    "+evaluate.task_params.lm_eval_tasks=[cpython_next_sentence]",
    "+evaluate.task_params.lm_eval_limit=4",
]


def varied_llama_folder(out: Path) -> Path:
    """The tiny Llama with larger random weights: peaked next-token distributions, so greedy decoding
    wanders through the vocabulary instead of repeating one token (a real check of the KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    tiny_llama_folder(out, max_positions=256)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> Path:
    return varied_llama_folder(tmp_path_factory.mktemp("ov_genai_llm") / "src")


@pytest.fixture(scope="module")
def tiny_hf(tiny_llm):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llm), attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def ov_fp32(tiny_llm, tmp_path_factory) -> Path:
    from engines.openvino.genai_build import export_stateful_lm

    return export_stateful_lm(tiny_llm, tmp_path_factory.mktemp("ov_genai") / "fp32")


@pytest.fixture(scope="module")
def runner(ov_fp32):
    from engines.openvino.genai_runner import OVGenAIRunner

    return OVGenAIRunner(ov_fp32.parent, threads=1)


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model, ids, new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


TEXT = "The return statement leaves the current function call with the expression list."


def test_export_is_stateful_and_llm_pipeline_runs_it(ov_fp32):
    import openvino as ov
    import openvino_genai

    folder = ov_fp32.parent
    for name in (
        "openvino_model.bin",
        "openvino_tokenizer.xml",
        "openvino_detokenizer.xml",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
    ):
        assert (folder / name).is_file(), name
    model = ov.Core().read_model(str(ov_fp32))
    assert {p.get_any_name() for p in model.inputs} == {"input_ids", "attention_mask", "position_ids", "beam_idx"}
    assert [p.get_any_name() for p in model.outputs] == ["logits"]
    ops = [op.get_type_name() for op in model.get_ops()]
    assert ops.count("ReadValue") == ops.count("Assign") == 2 * 2  # key and value of both layers
    # weights kept FP32 (save_model would have halved them to FP16)
    weights = {
        op.get_output_element_type(0).get_type_name()
        for op in model.get_ops()
        if op.get_type_name() == "Constant" and len(op.get_output_partial_shape(0)) == 2
    }
    assert "f32" in weights and not weights & {"f16", "bf16"}
    pipe = openvino_genai.LLMPipeline(str(folder), "CPU", INFERENCE_PRECISION_HINT="f32", INFERENCE_NUM_THREADS=1)
    assert isinstance(pipe.generate("def main():", max_new_tokens=4), str)
    result = pipe.generate(["def main():"], max_new_tokens=4, min_new_tokens=4)
    assert result.perf_metrics.get_num_generated_tokens() == 4


def test_scoring_matches_hugging_face(runner, tiny_hf):
    ids = runner.encode(TEXT)
    assert len(ids) > 10
    reference = hf_logits(tiny_hf, ids)
    logits = runner.logits(ids)
    assert logits.shape == reference.shape == (len(ids), runner.vocab_size)
    assert np.abs(logits - reference).max() < 1e-4
    import torch

    logp = torch.log_softmax(torch.tensor(reference, dtype=torch.float64), -1).numpy()
    expected = logp[np.arange(len(ids) - 1), ids[1:]][2:]
    np.testing.assert_allclose(runner.log_likelihood(ids, start=3), expected, atol=1e-4)
    batch = runner({"input_ids": np.array([ids[:8], ids[2:10]])})["logits"]
    assert batch.shape == (2, 8, runner.vocab_size) and batch.dtype == np.float32
    np.testing.assert_allclose(runner.logits(ids), logits)  # the state is reset between calls


def test_scoring_never_compiles_the_generation_pipeline(ov_fp32):
    """Each compiled model holds its own copy of the weights: a runner that only scores (the race's
    screens, the evaluation's fidelity and tasks) compiles the scoring model alone."""
    from engines.openvino.genai_runner import OVGenAIRunner

    scorer = OVGenAIRunner(ov_fp32.parent, threads=1)
    ids = scorer.encode(TEXT)
    scorer.log_likelihood(ids)
    assert scorer._pipe is None
    scorer.prepare_generation()  # what serve does before it says it is ready
    assert scorer._pipe is not None
    pipeline_ids = scorer.pipe.get_tokenizer().encode(TEXT).input_ids.data[0].tolist()
    assert ids == pipeline_ids  # the runner's own tokenizer reads the files the pipeline reads


def test_kv_cache_step_by_step_matches_one_pass(ov_fp32, tiny_hf, runner):
    """Prefill, then one token at a time through the internal state (past length > 0, growing mask,
    explicit positions): each step's logits equal the full forward pass's at that position."""
    import openvino as ov

    ids = runner.encode(TEXT)[:16]
    reference = hf_logits(tiny_hf, ids)
    core = ov.Core()
    request = core.compile_model(
        core.read_model(str(ov_fp32)), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    ).create_infer_request()
    request.reset_state()
    prefill = 6
    for start, stop in [(0, prefill)] + [(i, i + 1) for i in range(prefill, len(ids))]:
        chunk = np.array([ids[start:stop]], dtype=np.int64)
        request.infer(
            {
                "input_ids": chunk,
                "attention_mask": np.ones((1, stop), dtype=np.int64),
                "position_ids": np.arange(start, stop, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
        )
        got = request.get_tensor("logits").data[0]
        assert np.abs(got - reference[start:stop]).max() < 1e-4, (start, stop)


def test_greedy_generation_matches_hugging_face(runner, tiny_hf):
    from engines.onnxruntime_genai.runner import Sampling

    for text in ("A class definition", "def main():", TEXT):
        prompt = runner.encode(text)
        expected = hf_greedy(tiny_hf, prompt, 10)
        got = [t for t, _ in runner.generate(prompt, Sampling(max_new_tokens=10))]
        assert len(set(expected)) > 2, "the varied model should not repeat one token"
        stop = next((i for i, t in enumerate(expected) if t in runner.eos_token_ids), len(expected))
        assert got[:6] == expected[: min(6, stop)], text


def test_generate_streams_text_and_honours_limits(runner):
    from engines.onnxruntime_genai.runner import Sampling

    prompt = runner.encode("Once upon a time")
    tokens = list(runner.generate(prompt, Sampling(max_new_tokens=12)))
    assert 0 < len(tokens) <= 12
    assert "".join(piece for _, piece in tokens) == runner.decode([t for t, _ in tokens])
    seeded = [
        [t for t, _ in runner.generate(prompt, Sampling(max_new_tokens=8, temperature=0.9, seed=7))] for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    calls = []

    def cancelled():
        calls.append(1)
        return len(calls) >= 3

    assert len(list(runner.generate(prompt, Sampling(max_new_tokens=50), cancelled))) <= 4
    stamps = runner.timed_stream(prompt, 6)
    assert len(stamps) == 6 and stamps == sorted(stamps)
    assert runner.context_length == 256 and runner.eos_token_ids == {0}
    assert "<|assistant|>" in runner.chat_prompt([{"role": "user", "content": "hi"}])


def test_int4_compression_changes_weights_and_keeps_perplexity_finite(ov_fp32, runner, tmp_path):
    from engines.openvino.genai_compress import CompressionError, compress_weights, weight_precision
    from engines.openvino.genai_runner import OVGenAIRunner

    before = weight_precision(ov_fp32)
    assert set(before) == {"float"} and before["float"]["count"] == 2 * 7 + 2  # 7 projections/layer, embed, head
    xml = compress_weights(ov_fp32, tmp_path / "int4", mode="int4_asym", group_size=32)
    after = weight_precision(xml)
    assert after["int4"]["count"] == 2 * 7 and "layers.1/mlp/down_proj" in after["int4"]["nodes"]
    assert set(after["int8"]["nodes"]) == {"embed_tokens", "lm_head"}  # NNCF's INT8 backup
    assert (tmp_path / "int4" / "openvino_tokenizer.xml").is_file()
    int4 = OVGenAIRunner(xml.parent, threads=1)
    ids = runner.encode(TEXT * 3)
    ppl = {name: float(np.exp(-r.log_likelihood(ids).mean())) for name, r in (("fp32", runner), ("int4", int4))}
    assert np.isfinite(ppl["int4"]) and ppl["int4"] != ppl["fp32"]
    with pytest.raises(CompressionError, match="group size"):
        compress_weights(ov_fp32, tmp_path / "bad", mode="int4_sym", group_size=48)  # 48 does not divide 64


def test_data_aware_int4_and_mixed_ratio(ov_fp32, runner, tmp_path):
    from engines.openvino.genai_compress import calibration_inputs, compress_weights, weight_precision

    batches = calibration_inputs([runner.encode(TEXT), runner.encode("A class definition creates a class object.")])
    xml = compress_weights(
        ov_fp32,
        tmp_path / "awq",
        mode="int4_asym",
        group_size=32,
        ratio=0.5,
        awq=True,
        scale_estimation=True,
        calibration_batches=batches,
    )
    layers = weight_precision(xml)
    assert 0 < layers["int4"]["count"] < 2 * 7 and layers["int8"]["count"] > 2


def test_lora_correction_adds_int8_adapters_and_sensitivity_ranks_by_activations(ov_fp32, runner, tmp_path):
    from engines.openvino.genai_compress import CompressionError, calibration_inputs, compress_weights, weight_precision
    from engines.openvino.genai_runner import OVGenAIRunner

    batches = calibration_inputs([runner.encode(TEXT * 2), runner.encode("A class definition creates a class object.")])
    common = dict(mode="int4_asym", group_size=32, awq=True, scale_estimation=True, calibration_batches=batches)
    plain = compress_weights(ov_fp32, tmp_path / "awq", **common)
    lora = compress_weights(ov_fp32, tmp_path / "lora", lora_correction=True, lora_adapter_rank=4, **common)
    plain_layers, lora_layers = weight_precision(plain), weight_precision(lora)
    assert plain_layers["int4"]["count"] == lora_layers["int4"]["count"] == 2 * 7
    # Each 4-bit MatMul gains two low-rank INT8 adapter MatMuls beside it.
    assert lora_layers["int8"]["count"] == plain_layers["int8"]["count"] + 2 * 2 * 7
    ids = runner.encode(TEXT * 3)
    scores = [OVGenAIRunner(xml.parent, threads=1).log_likelihood(ids).mean() for xml in (plain, lora)]
    assert np.isfinite(scores).all() and scores[0] != scores[1]
    ranked = compress_weights(
        ov_fp32,
        tmp_path / "hessian",
        mode="int4_asym",
        group_size=32,
        ratio=0.5,
        sensitivity_metric="hessian_input_activation",
        calibration_batches=batches,
    )
    assert 0 < weight_precision(ranked)["int4"]["count"] < 2 * 7
    with pytest.raises(CompressionError, match="need calibration_batches"):
        compress_weights(ov_fp32, tmp_path / "x", ratio=0.5, sensitivity_metric="mean_activation_variance")
    with pytest.raises(CompressionError, match="do not combine"):
        compress_weights(ov_fp32, tmp_path / "y", gptq=True, lora_correction=True, calibration_batches=batches)


@pytest.fixture(scope="module")
def cli_artifact(tiny_llm, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ov_genai_cli")
    out = workdir / "artifact"
    proc = run_optimize(
        f"model.source={tiny_llm}",
        *TINY_OV_OVERRIDES,
        "engine.params.group_size=32",
        f"output_dir={out}",
        f"hydra.run.dir={workdir / 'run'}",
    )
    return proc, out


def test_engine_method_through_the_command_line(cli_artifact):
    proc, out = cli_artifact
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: the speed gate, shared CPU
    manifest = json.loads((out / "manifest.json").read_text())
    engine = manifest["engine"]
    assert engine["format"] == "openvino-genai" and engine["inference_precision"] == "f32"
    assert engine["precision"] == "int4" and engine["task"] == "causal_lm"
    # the engine config's KV cache, recorded where scoring and serve both read it
    assert engine["kv_cache_precision"] == "u8" and manifest["stages"]["engine"]["kv_cache_precision"] == "u8"
    assert (out / engine["dir"] / "openvino_model.xml").is_file()
    stage = manifest["stages"]["engine"]
    assert stage["nncf"]["group_size"] == 32 and stage["nncf"]["mode"] == "int4_asym"
    assert stage["nncf"]["ratio"] == 0.8 and stage["nncf"]["sensitivity_metric"] == "hessian_input_activation"
    assert 0 < stage["layer_precision"]["int4"]["count"] < 2 * 7  # 80% at 4 bits, NNCF rounds per layer
    cand = manifest["metrics"]["candidate"]
    assert np.isfinite(cand["perplexity"]) and cand["generation"]["runs"] == 3
    assert "weights kept at int4" in proc.stdout and "openvino-genai" in proc.stdout


def test_group_size_the_model_cannot_take_is_one_error_line(tiny_llm, tmp_path):
    proc = run_optimize(
        f"model.source={tiny_llm}",
        *TINY_OV_OVERRIDES,
        "engine.params.group_size=48",
        f"output_dir={tmp_path / 'a'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_error_line(proc, "openvino_genai", "group size", log_lines=True)


def test_served_over_the_openai_protocol(cli_artifact):
    import httpx
    import openai

    from tests.support.serve import metric_value, running_server

    proc, out = cli_artifact
    assert (out / "manifest.json").is_file(), proc.stderr[-2000:]
    with running_server(out, "--max-tokens", "32", "--allow-failed-gate") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        whole = client.completions.create(model=name, prompt="def main():", max_tokens=8, temperature=0)
        assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens <= 8
        pieces = [
            c.choices[0].text
            for c in client.completions.create(
                model=name, prompt="def main():", max_tokens=8, temperature=0, stream=True
            )
            if c.choices
        ]
        assert "".join(pieces) == whole.choices[0].text
        messages = [{"role": "user", "content": "What is Python?"}]
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
        deltas = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=name, messages=messages, max_tokens=8, temperature=0, stream=True
            )
        ]
        assert "".join(deltas) == reply.choices[0].message.content
        # served with the KV cache the gate scored
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert metric_value(text, "serve_kv_cache_bytes", precision="u8") > 0
