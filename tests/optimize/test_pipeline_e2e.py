"""End to end through `python -m optimize`, on the real MiniLM model and real held-out text."""

import signal
import subprocess
import sys
import time

import numpy as np

import engines
from engines.artifact import read_manifest, verify
from engines.text import TextEncoder
from optimize.compile.race.candidates import default_candidates
from tests.support.cli import FAST_OVERRIDES, ROOT, one_error_line, run_optimize


def test_default_recipe_end_to_end_on_a_small_evaluation_set(minilm_default_race):
    # The default recipe as shipped (the engine race, every candidate built afresh), with small counts:
    # the session's run (tests/conftest.py), which the race's other tests read too.
    proc, out = minilm_default_race.proc, minilm_default_race.artifact
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gate: PASSED" in proc.stdout and f"artifact: {out}" in proc.stdout
    for row in (
        "latency p50 ms, batch 1",
        "latency p95 ms, batch 4",
        "size on disk MB",
        "peak memory MB",
        "cosine vs baseline (min)",
        "top-5 neighbour agreement",
    ):
        assert row in proc.stdout

    manifest = read_manifest(out)
    assert verify(out) == []
    assert manifest["recipe"]["name"] == "minilm_int8_cpu" and manifest["verdict"] == "passed"
    assert manifest["gate"]["passed"] and {c["name"] for c in manifest["gate"]["checks"]} == {
        "min_cosine",
        "min_mean_cosine",
        "min_topk_agreement",
    }
    base, cand = manifest["metrics"]["baseline"], manifest["metrics"]["candidate"]
    assert base["engine"] == "pytorch" and cand["engine"] in ("onnxruntime", "openvino")
    for side in (base, cand):
        assert set(side["latency"]) == {"1", "4"}
        assert 0 < side["latency"]["1"]["p50_ms"] <= side["latency"]["1"]["p95_ms"] <= side["latency"]["1"]["p99_ms"]
        assert side["peak_memory_mb"] > 0 and side["size_mb"] > 0
    assert cand["speedup"]["1"] == base["latency"]["1"]["p50_ms"] / cand["latency"]["1"]["p50_ms"]
    calib, evaluation = manifest["calibration"], manifest["evaluation"]
    assert calib["count"] == 16 and calib["seed"] == 0 and len(calib["sha256"]) == 64
    assert evaluation["split"] == "evaluation" and evaluation["dropped_overlap"] == 0
    # The race: one export, fused into ONNX Runtime's kernels and checked against PyTorch; every
    # candidate recorded; the shipped one passed every accuracy check and is the fastest that did.
    race = manifest["stages"]["engine"]
    export = race["export"]
    assert export["ort_fusions"]["attention"] == 6 and export["ort_fusions"]["skip_layer_normalization"] == 12
    assert export["export_check"]["sentence_embedding"]["min_cosine"] > 0.9999
    names = [c["name"] for c in race["candidates"]]
    assert names == default_candidates(generates=False)
    assert not any(c["cached"] for c in race["candidates"])  # its cache was empty: each one built here
    winner = next(c for c in race["candidates"] if c["name"] == race["winner"])
    assert winner["passed_accuracy"] and winner["outcome"].startswith("won")
    passing = [c for c in race["candidates"] if c["passed_accuracy"]]
    assert winner["latency"]["1"]["p50_ms"] == min(c["latency"]["1"]["p50_ms"] for c in passing)
    assert race["int8_gemm"]["speedup"] > 0 and (out / "race" / "front.png").is_file()
    assert "engine race" in proc.stdout and "INT8 GEMM" in proc.stdout
    assert manifest["environment"]["packages"]["onnxruntime"]
    assert manifest["model"]["sha256"]["model.safetensors"]

    # What was measured is what ships: the artifact's own runner and tokenizer give unit embeddings.
    runner = engines.load(out)
    inputs = TextEncoder(out / "tokenizer", 128)(["The capital of Italy is Rome.", "def f(x): return x"])
    embedding = runner(inputs)["sentence_embedding"]
    assert embedding.shape == (2, 384) and np.allclose(np.linalg.norm(embedding, axis=1), 1, atol=1e-3)


def test_failed_gate_exits_1_and_keeps_the_artifact_marked_failed(failed_gate_run):
    # The session's run whose gate cannot pass (min_cosine 1.01; the other checks at the fast settings'
    # thresholds, which INT8 passes): the fixture checked its exit code, 1.
    proc, out = failed_gate_run.proc, failed_gate_run.artifact
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "gate: FAILED" in proc.stdout and "FAIL" in proc.stdout
    manifest = read_manifest(out)
    assert manifest["verdict"] == "failed" and not manifest["gate"]["passed"]
    failed = [c for c in manifest["gate"]["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["min_cosine"] and failed[0]["value"] < 1.01


def test_onnx_file_source_with_random_inputs(tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    source = tmp_path / "mlp.onnx"
    torch.onnx.export(
        model,
        (torch.randn(2, 32),),
        str(source),
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "batch"}},
        dynamo=False,
    )
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={source}",
        "model.task=generic",
        "evaluate.inputs=random",
        "evaluate.data.count=8",
        "evaluate.batch_sizes=[1,4]",
        "evaluate.repeats=5",
        "evaluate.memory=false",
        "engine=onnx",
        "quantize=ort_int8_dynamic",
        "quantize.params.fallback_min_cosine=null",
        "gate=none",
        "gate.min_cosine=0.9",
        "gate.max_abs_error=1.0",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = read_manifest(out)
    assert manifest["evaluation"] == {"source": "random", "count": 8, "seed": 1}
    fidelity = manifest["metrics"]["candidate"]["fidelity"]
    assert set(fidelity["outputs"]) == {"y"} and fidelity["cosine_min"] > 0.9
    assert manifest["engine"]["inputs"] == [{"name": "x", "type": "tensor(float)", "shape": ["batch", 32]}]


def test_onnx_file_source_without_inputs_asks_for_them(tmp_path, minilm_artifact):
    proc = run_optimize(
        f"model.source={minilm_artifact / 'model.onnx'}",
        "model.task=generic",
        "gate=none",
        "gate.min_cosine=0.9",
        f"output_dir={tmp_path / 'out'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_error_line(proc, "evaluate.inputs=random")
    assert not (tmp_path / "out").exists()


def test_onnx_file_source_evaluated_on_text_through_its_tokenizer(tmp_path, minilm_artifact):
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={minilm_artifact / 'model.onnx'}",
        "model.task=generic",
        f"model.tokenizer={minilm_artifact / 'tokenizer'}",
        "quantize=none",
        # The graph as it came, on ONNX Runtime: the text reaching it through its tokenizer is what is
        # tested here, not the default race over it (the race has tests of its own).
        "engine=onnx",
        "gate=none",
        "gate.min_cosine=0.999",
        "evaluate.data.count=8",
        "evaluate.batch_sizes=[2]",
        "evaluate.memory=false",
        "evaluate.repeats=5",
        "evaluate.retimes=0",  # no speed gated; the other test worker shares the machine
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = read_manifest(out)
    fidelity = manifest["metrics"]["candidate"]["fidelity"]
    # The same graph re-shipped: every output matches the original exactly.
    assert set(fidelity["outputs"]) == {"last_hidden_state", "sentence_embedding"}
    assert fidelity["max_abs_error"] == 0.0
    assert manifest["parent_id"] == read_manifest(minilm_artifact)["id"]  # made from that artifact


def test_sigterm_midway_leaves_no_artifact(tmp_path):
    out = tmp_path / "artifact"
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimize", *FAST_OVERRIDES, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".artifact.partial-*/artifact/tokenizer")):
        time.sleep(0.2)
    assert list(tmp_path.glob(".artifact.partial-*")), "the run never started staging"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "nothing was written" in stderr
    assert not out.exists() and not list(tmp_path.glob(".artifact*"))
