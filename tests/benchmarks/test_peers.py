"""benchmarks/peers.py's building blocks on tiny inputs: the ratio arithmetic, the ISA choice, and a
real race (PyTorch, an ONNX Runtime artifact, Optimum's recipe reproduced, OpenVINO FP32) on 4 texts
at batch 1. The NNCF and Optimum-venv builds are left to the script itself (minutes, a second venv)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from serve.arguments import weights as weights_flag

ROOT = Path(__file__).resolve().parents[2]


def load_peers():
    spec = importlib.util.spec_from_file_location("peers_bench", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_bench"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


peers = load_peers()


def entry(name, role, p50, cosine_min):
    return peers.Entry(
        name,
        role,
        runner=None,
        recipe="",
        fidelity={"cosine_min": cosine_min, "cosine_mean": 1.0},
        p50_ms={"1": p50, "32": p50 * 20},
    )


def test_ratios_pick_the_fastest_peer_that_keeps_fidelity():
    entries = [
        entry("torch", "baseline", 20.0, 1.0),
        entry("ours", "artifact", 5.0, 0.995),
        entry("fast but wrong", "peer", 2.0, 0.97),
        entry("slow", "peer", 10.0, 1.0),
        entry("good", "peer", 8.0, 0.992),
    ]
    table = peers.ratios(entries, ["1", "32"])
    assert table["1"]["best_peer"] == table["32"]["best_peer"] == "good"  # the 0.97 peer is not eligible
    assert table["1"]["over_pytorch"]["ours"] == pytest.approx(4.0)
    assert table["1"]["over_best_peer"]["ours"] == pytest.approx(8.0 / 5.0)
    assert table["32"]["over_best_peer"]["slow"] == pytest.approx(160.0 / 200.0)
    assert table["1"]["over_best_peer"]["good"] == pytest.approx(1.0)


def test_the_weighted_cost_follows_the_workload_and_can_pick_another_best_peer(tmp_path):
    entries = [
        entry("torch", "baseline", 20.0, 1.0),
        entry("ours", "artifact", 5.0, 0.995),
        entry("fast at 1", "peer", 4.0, 1.0),
        entry("fast at 32", "peer", 6.0, 1.0),
    ]
    entries[2].p50_ms["32"] = 200.0  # 4 ms at batch 1, but the slowest at batch 32
    mix = peers.weighted(entries, {"1": 0.5, "32": 0.5})
    assert mix["best_peer"] == "fast at 32"  # 0.5 * 6 + 0.5 * 120 = 63 ms against 102 ms
    assert mix["cost_ms"]["ours"] == pytest.approx(52.5)
    assert mix["over_best_peer"]["ours"] == pytest.approx(63.0 / 52.5)
    from optimize.artifact import write_manifest

    root = tmp_path / "a"
    root.mkdir()
    write_manifest(root, {"engine": {}, "metrics": {"workload": {"batches": {"1": 0.7, "32": 0.3, "8": 1.0}}}})
    weights = peers.workload_weights(root, ["1", "32"], None)  # batch 8 is not timed here: left out
    assert weights == pytest.approx({"1": 0.7, "32": 0.3})
    assert peers.workload_weights(root, ["1", "32"], weights_flag("1:1,32:3")) == pytest.approx({"1": 0.25, "32": 0.75})


def test_no_eligible_peer_gives_no_ratio():
    entries = [
        entry("torch", "baseline", 20.0, 1.0),
        entry("ours", "artifact", 5.0, 0.995),
        entry("wrong", "peer", 2.0, 0.9),
    ]
    table = peers.ratios(entries, ["1"])
    assert table["1"]["best_peer"] is None and table["1"]["over_best_peer"]["ours"] is None


def test_optimum_isa_follows_the_cpu_flags():
    assert peers.optimum_isa(frozenset({"avx2", "avx512f", "avx512_vnni"})) == "avx512_vnni"
    assert peers.optimum_isa(frozenset({"avx2", "avx512f"})) == "avx512"
    assert peers.optimum_isa(frozenset({"avx2", "avx_vnni"})) == "avx2"
    assert peers.optimum_isa(frozenset(), "aarch64") == "arm64"


def tiny_artifact(onnx_path: Path, model_dir: str, root: Path) -> Path:
    """An artifact directory around an ONNX file: manifest engine block and tokenizer, nothing else."""
    import shutil

    root.mkdir()
    shutil.copyfile(onnx_path, root / "model.onnx")
    shutil.copytree(model_dir, root / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors", "1_Pooling"))
    engine = {
        "format": "onnxruntime",
        "file": "model.onnx",
        "precision": "fp32",
        "task": "sentence_embedding",
        "max_length": 128,
        "tokenizer": "tokenizer",
    }
    from optimize.artifact import write_manifest

    write_manifest(root, {"engine": engine, "recipe": {"name": "tiny"}})
    return root


def test_a_tiny_race_runs_and_its_ratios_match_the_timings(tmp_path):
    pytest.importorskip("openvino")
    import engines
    from engines.onnxruntime.runner import OrtRunner
    from engines.pytorch.runner import read_pooling
    from engines.text import TextEncoder

    model_dir = peers.default_model_dir()
    module, torch_runner = peers.pytorch_baseline(model_dir, 0)
    # The FP32 unfused export, wrapped as an artifact, stands in for a pipeline artifact.
    example = TextEncoder(model_dir, 128)(peers.texts("calibration", 2, seed=0))
    export = peers.unfused_export(module, example, tmp_path / "unfused.onnx")
    artifact = tiny_artifact(export, model_dir, tmp_path / "artifact")
    encode = peers.artifact_encoder(artifact)
    optimum_like = peers.reproduce_optimum_recipe(export, tmp_path / "optimum.onnx", "avx512_vnni")
    entries = [
        peers.Entry(peers.BASELINE, "baseline", torch_runner, ""),
        peers.Entry(peers.ARTIFACT, "artifact", engines.load(artifact), ""),
        peers.Entry("ORT INT8", "peer", peers.MeanPooled(OrtRunner(optimum_like), read_pooling(Path(model_dir))), ""),
        peers.Entry("OpenVINO FP32", "peer", peers.OvRunner(peers.openvino_fp32(export, tmp_path)), ""),
    ]
    inputs = encode(peers.texts("evaluation", 4, seed=1))
    peers.measure_fidelity(entries, inputs)
    latency = peers.measure_latency(entries, inputs, 1, warmup=1, repeats=5, retries=0, busy_share=1.0)
    table = peers.ratios(entries, ["1"])

    assert entries[1].fidelity["cosine_min"] > 0.9999  # the FP32 export is the model
    assert entries[3].fidelity["cosine_min"] > 0.9999  # so is OpenVINO's FP32 conversion
    assert entries[2].fidelity["cosine_min"] > 0.9  # INT8 of every MatMul and Gather: close, not exact
    stats = latency["stats"]
    assert table["1"]["over_pytorch"]["OpenVINO FP32"] == pytest.approx(
        stats[peers.BASELINE]["p50_ms"] / stats["OpenVINO FP32"]["p50_ms"]
    )
    best = table["1"]["best_peer"]
    assert best in ("OpenVINO FP32", "ORT INT8")
    assert table["1"]["over_best_peer"][peers.ARTIFACT] == pytest.approx(
        stats[best]["p50_ms"] / stats[peers.ARTIFACT]["p50_ms"]
    )
    env = peers.environment({"skipped": {}})
    mix = peers.weighted(entries, peers.workload_weights(artifact, ["1"], None))
    assert mix["weights"] == {"1": 1.0} and mix["best_peer"] == best  # one batch size: the plain ranking
    report = peers.markdown(entries, ["1"], table, {"1": latency}, env, {"skipped": {}}, mix)
    assert report.count("\n| ") == len(entries) + 1 and env["cpu"] in report
