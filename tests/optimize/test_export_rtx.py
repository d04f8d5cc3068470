"""RTX edge bundles (`python -m optimize.export ARTIFACT --bundle DIR --tensorrt-rtx`): an
engine=tensorrt_rtx artifact's plan, tokenizer, the plan runner and run.py, requirements pinning the
TensorRT-RTX the plan was built with; verified like every bundle, and refused by run.py with one
line on a machine without an RTX-class GPU. The same artifact still bundles its ONNX graph for CPUs.
One MiniLM FP16 run builds the artifact (~35 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'optimize[tensorrt-rtx]')")

from tests.support.cli import ROOT, one_error_line, run_optimize  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "A str is an immutable sequence of Unicode code points."]


@pytest.fixture(scope="module")
def rtx_artifact(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("rtx")
    out = work / "artifact"
    proc = run_optimize(
        "recipe=minilm_fp16_rtx",
        "evaluate.data.count=8",
        "calibration.count=8",
        "evaluate.batch_sizes=[1,4]",
        "model.max_length=32",
        f"output_dir={out}",
        f"hydra.run.dir={work / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def python(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True)


def test_the_minilm_fp16_preset_builds_its_plan(rtx_artifact):
    manifest = json.loads((rtx_artifact / "manifest.json").read_text())
    plan = manifest["engine"]["plan"]
    assert manifest["engine"]["precision"] == "fp16" and manifest["stages"]["quantize"]["method"] == "ort_fp16"
    assert plan["profiles"][1]["input_ids"][2] == [4, 32]  # batch 4, model.max_length
    assert manifest["metrics"]["candidate"]["fidelity"]["cosine_min"] > 0.999


def test_the_plan_bundle_carries_the_plan_and_its_runner(rtx_artifact, tmp_path):
    bundle = tmp_path / "rtx-bundle"
    proc = python("-m", "optimize.export", rtx_artifact, "--bundle", bundle, "--tensorrt-rtx")
    assert proc.returncode == 0, proc.stderr
    assert "tensorrt-rtx-plan" in proc.stdout
    manifest = json.loads((bundle / "manifest.json").read_text())
    engine = manifest["engine"]
    assert engine["format"] == "tensorrt-rtx" and engine["file"] == "model.plan"
    assert engine["plan"]["built_from"] == "model.onnx" and engine["plan"]["latency"].startswith("not measured")
    files = {f["path"] for f in manifest["files"]}
    assert {
        "model.plan",
        "run.py",
        "runtimes.py",
        "artifact/__init__.py",
        "tensorrt_rtx_runner.py",
        "requirements.txt",
    } <= files
    assert "model.onnx" not in files and any(f.startswith("tokenizer/") for f in files)
    requirements = (bundle / "requirements.txt").read_text().splitlines()[1:]
    assert requirements[:2] == ["tensorrt-rtx==1.7.1.116", "cuda-python>=12.6"]
    assert requirements[2].startswith("tokenizers==") and requirements[3].startswith("numpy==")
    assert python("-m", "optimize.verify", bundle).returncode == 0
    # -I: no project on the path; without an RTX GPU (or cuda-python) run.py says what is missing.
    from engines.tensorrt_rtx.runner import missing

    if missing():
        ran = python("-I", bundle / "run.py", *TEXTS)
        one_error_line(ran, "a TensorRT-RTX plan needs " + "; ".join(missing()))
        assert sorted(p.name for p in bundle.iterdir()) == sorted({f.split("/")[0] for f in files} | {"manifest.json"})


def test_the_same_artifact_bundles_its_onnx_graph_for_cpus(rtx_artifact, tmp_path):
    bundle = tmp_path / "cpu-bundle"
    assert python("-m", "optimize.export", rtx_artifact, "--bundle", bundle).returncode == 0
    ran = python("-I", bundle / "run.py", *TEXTS)
    assert ran.returncode == 0, ran.stderr
    assert len([json.loads(line) for line in ran.stdout.splitlines()]) == 2


def test_refusals_are_one_line(rtx_artifact, tmp_path):
    both = python("-m", "optimize.export", rtx_artifact, "--bundle", tmp_path / "b", "--tensorrt-rtx", "--ort-format")
    one_error_line(both, "--tensorrt-rtx and --ort-format choose different model files")
    assert not (tmp_path / "b").exists()


def test_an_artifact_without_a_plan_is_refused():
    from optimize.errors import RecipeError
    from optimize.export.bundle import with_plan_engine

    onnx_only = {"engine": {"format": "onnxruntime", "file": "model.onnx", "task": "sentence_embedding"}, "files": []}
    with pytest.raises(RecipeError, match="has no TensorRT-RTX plan"):
        with_plan_engine(Path("art"), onnx_only, ort_format=False)
    listed_nowhere = {"engine": {**onnx_only["engine"], "plan": {"file": "model.plan"}}, "files": []}
    with pytest.raises(RecipeError, match="has no TensorRT-RTX plan"):
        with_plan_engine(Path("art"), listed_nowhere, ort_format=False)
