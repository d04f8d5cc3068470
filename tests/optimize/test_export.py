"""Edge and laptop bundles (`python -m optimize.export ARTIFACT --bundle DIR`): run in a fresh virtual
environment that has only the bundle's three packages, embed exactly as the server does, refuse
changed files, and refuse bad inputs with one line and nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from engines.artifact import MANIFEST
from optimize.artifact import publish, staging, write_manifest
from tests.support.cli import ROOT, one_error_line

TEXTS = ["The quick brown fox jumps over the lazy dog.", "A str is an immutable sequence of Unicode code points."]


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimize.export", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


def make_venv(folder: Path, requirements: Path) -> Path:
    """A fresh virtual environment (no system or project packages) with only the bundle's requirements."""
    venv.EnvBuilder(with_pip=True).create(folder)
    python = folder / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", requirements],
        check=True,
        capture_output=True,
        text=True,
    )
    return python


def run_bundle(python: Path, bundle: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # -I: isolated mode, so neither PYTHONPATH (this project) nor the user's site-packages can help.
    return subprocess.run([python, "-I", bundle / "run.py", *args], cwd=cwd, capture_output=True, text=True)


def served_embeddings(artifact: Path, texts: list[str]) -> np.ndarray:
    """What `python -m serve` answers for these texts: its encoder, on the artifact itself."""
    from engines.artifact import read_manifest
    from serve.encoder import EncoderModel

    model = EncoderModel(artifact, read_manifest(artifact)["engine"])
    return model.run_batch([model.from_texts(texts)])[0]["sentence_embedding"]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def bundles(minilm_artifact, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    made = {}
    for name, flags in (("onnx", []), ("ort", ["--ort-format"])):
        proc = export(minilm_artifact, "--bundle", root / name, *flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr == "" and f"bundle: {root / name}" in proc.stdout
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def bundle_python(bundles, tmp_path_factory) -> Path:
    return make_venv(tmp_path_factory.mktemp("venv") / "env", bundles["ort"] / "requirements.txt")


def test_the_fresh_environment_has_only_the_three_packages_and_their_dependencies(bundle_python, bundles):
    assert (bundles["ort"] / "requirements.txt").read_text().splitlines()[1:] == [
        f"{name}=={metadata.version(name)}" for name in ("onnxruntime", "tokenizers", "numpy")
    ]
    listed = subprocess.run(
        [bundle_python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert {"onnxruntime", "tokenizers", "numpy"} <= installed
    assert not installed & {"torch", "optimize", "transformers", "onnx", "openvino", "hydra-core"}


@pytest.mark.parametrize("kind", ["onnx", "ort"])
def test_a_bundle_embeds_as_the_server_does_in_the_fresh_environment(
    kind, bundles, bundle_python, minilm_artifact, tmp_path
):
    out = tmp_path / "embeddings.npy"
    proc = run_bundle(bundle_python, bundles[kind], *TEXTS, "--output", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vectors = np.load(out, allow_pickle=False)
    served = served_embeddings(minilm_artifact, TEXTS)
    assert vectors.shape == served.shape == (2, 384)
    assert cosines(vectors, served).min() > 0.99999
    # JSON lines on stdout, texts from stdin: the same vectors.
    lines = subprocess.run(
        [bundle_python, "-I", bundles[kind] / "run.py"], input="\n".join(TEXTS) + "\n", capture_output=True, text=True
    )
    assert lines.returncode == 0, lines.stderr
    assert np.allclose(np.array([json.loads(line) for line in lines.stdout.splitlines()]), vectors, atol=1e-6)
    # Running it left the bundle exactly as its manifest lists it (no __pycache__ beside the checker).
    verified = subprocess.run(
        [sys.executable, "-m", "optimize.verify", bundles[kind]], cwd=ROOT, capture_output=True, text=True
    )
    assert verified.returncode == 0 and "match the manifest" in verified.stdout, verified.stdout + verified.stderr


def test_the_ort_bundle_carries_the_ort_model_and_its_reduced_operator_set(bundles, minilm_artifact):
    ort, source = bundles["ort"], json.loads((minilm_artifact / MANIFEST).read_text())
    manifest = json.loads((ort / MANIFEST).read_text())
    assert manifest["engine"]["file"] == "model.ort" and not (ort / "model.onnx").exists()
    assert manifest["bundle"]["source_digest"] == source["integrity"]["digest"]
    assert manifest["bundle"]["model_format"] == "ort"
    operators = (ort / manifest["bundle"]["operators_config"]).read_text()
    assert "com.microsoft;1;" in operators and "# - model.ort" in operators and "/tmp" not in operators
    # The checker in the bundle is the project's checker, byte for byte, and listed in the manifest.
    assert (ort / "artifact.py").read_bytes() == (ROOT / "engines" / "artifact.py").read_bytes()
    listed = {f["path"] for f in manifest["files"]}
    tokenizer = {f["path"] for f in source["files"] if f["path"].startswith("tokenizer/")}
    bundle_files = {"run.py", "artifact.py", "requirements.txt", "model.ort", "model.required_operators.config"}
    assert listed == bundle_files | tokenizer
    # run.py needs nothing from this project.
    source_code = (ort / "run.py").read_text()
    assert not any(f"import {m}" in source_code or f"from {m}" in source_code for m in ("optimize", "engines", "torch"))


def test_a_bundle_whose_files_were_changed_refuses_to_run(bundles, bundle_python, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(bundles["onnx"], changed)
    with open(changed / "tokenizer" / "tokenizer.json", "ab") as f:
        f.write(b" ")
    out = tmp_path / "out.npy"
    proc = run_bundle(bundle_python, changed, "hello", "--output", str(out), cwd=tmp_path)
    one_error_line(proc, "does not match its manifest", "changed file tokenizer/tokenizer.json")
    assert not out.exists() and proc.stdout == ""
    # optimize.verify reports it as it reports a changed artifact (exit 1).
    verified = subprocess.run([sys.executable, "-m", "optimize.verify", changed], capture_output=True, text=True)
    assert verified.returncode == 1 and "changed file tokenizer/tokenizer.json" in verified.stdout


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(minilm_artifact, tmp_path):
    bundle = tmp_path / "bundle"
    one_error_line(export(tmp_path / "nothing-here", "--bundle", bundle), "nothing-here")
    tampered = tmp_path / "tampered"
    shutil.copytree(minilm_artifact, tampered)
    (tampered / "tokenizer" / "tokenizer_config.json").write_text("{}")
    one_error_line(export(tampered, "--bundle", bundle), "does not match its manifest", "tokenizer_config.json")
    one_error_line(export(minilm_artifact, "--bundle", minilm_artifact / "inside"), "inside the artifact")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    one_error_line(export(minilm_artifact, "--bundle", busy), "not empty")
    one_error_line(export(minilm_artifact), "--bundle")
    assert not bundle.exists() and not (minilm_artifact / "inside").exists()
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_openvino_genai_artifacts_are_refused_with_one_line(tmp_path):
    """An OpenVINO GenAI artifact's manifest (written and sealed as the pipeline writes one): the
    refusal comes before any model file is read."""
    artifact = tmp_path / "ov-genai"
    with staging(artifact) as stage:
        (stage / "model").mkdir()
        (stage / "model" / "openvino_model.xml").write_text("<net/>")
        write_manifest(
            stage,
            {
                "id": "ov-genai-test",
                "engine": {"format": "openvino-genai", "task": "causal_lm", "dir": "model"},
                "gate": {"passed": True, "checks": []},
                "verdict": "passed",
            },
        )
        publish(stage, artifact)
    proc = export(artifact, "--bundle", tmp_path / "bundle")
    one_error_line(proc, "'openvino-genai' engine cannot be bundled", "python -m serve")
    assert not (tmp_path / "bundle").exists()


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> Path:
    """A real ONNX Runtime GenAI artifact (random-weight 2-layer Llama, tests/support/tiny_llm.py)."""
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path_factory.mktemp("tiny_llm") / "artifact"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.tiny_llm", str(out)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_a_causal_lm_bundle_generates_as_the_server_does_with_onnxruntime_genai_and_numpy_only(tiny_llm, tmp_path):
    from engines import load_engine
    from engines.artifact import read_manifest
    from engines.genai_runner import Sampling

    bundle = tmp_path / "bundle"
    proc = export(tiny_llm, "--bundle", bundle)
    assert proc.returncode == 0, proc.stderr
    requirements = bundle / "requirements.txt"
    assert [line.split("==")[0] for line in requirements.read_text().splitlines()[1:]] == ["onnxruntime-genai", "numpy"]
    # The test artifact records no package versions: pin what this environment has, so pip takes its cache.
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(
        "".join(f"{name}=={metadata.version(name)}\n" for name in ("onnxruntime-genai", "onnxruntime", "numpy"))
    )
    venv.EnvBuilder(with_pip=True).create(tmp_path / "env")
    python = tmp_path / "env" / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", requirements, "-c", constraints],
        check=True,
        capture_output=True,
    )
    prompts = ["The Python standard library", "def main():"]
    out = tmp_path / "continuations.json"
    ran = run_bundle(python, bundle, *prompts, "--max-tokens", "12", "--output", str(out), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    runner = load_engine(tiny_llm, read_manifest(tiny_llm)["engine"])
    served = [runner.decode([t for t, _ in runner.generate(runner.encode(p), Sampling(12))]) for p in prompts]
    assert json.loads(out.read_text()) == served and all(served)
    one_error_line(export(tiny_llm, "--bundle", tmp_path / "ort", "--ort-format"), "--ort-format converts")


def test_an_openvino_bundle_runs_with_openvino_tokenizers_and_numpy_only(openvino_artifact, tmp_path):
    bundle = tmp_path / "bundle"
    proc = export(openvino_artifact, "--bundle", bundle)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs openvino==" in proc.stdout and not (bundle / "model.onnx").exists()
    # The IR and its weights, the tokenizer, the bundle's own files: nothing else the artifact holds.
    xml = json.loads((openvino_artifact / MANIFEST).read_text())["engine"]["file"]
    listed = {f["path"] for f in json.loads((bundle / MANIFEST).read_text())["files"]}
    assert {xml, xml[: -len(".xml")] + ".bin", "run.py", "artifact.py", "requirements.txt"} <= listed
    assert all(
        p.startswith("tokenizer/")
        for p in listed - {xml, xml[:-4] + ".bin", "run.py", "artifact.py", "requirements.txt"}
    )
    assert [line.split("==")[0] for line in (bundle / "requirements.txt").read_text().splitlines()[1:]] == [
        "openvino",
        "tokenizers",
        "numpy",
    ]
    python = make_venv(tmp_path / "env", bundle / "requirements.txt")
    out = tmp_path / "embeddings.npy"
    ran = run_bundle(python, bundle, *TEXTS, "--output", str(out), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert cosines(np.load(out), served_embeddings(openvino_artifact, TEXTS)).min() > 0.9999
    refused = export(openvino_artifact, "--bundle", tmp_path / "ort", "--ort-format")
    one_error_line(refused, "--ort-format converts ONNX Runtime graphs")


def test_a_signed_bundle_runs_with_its_key_and_refuses_another(minilm_artifact, bundle_python, tmp_path):
    key, other = tmp_path / "key", tmp_path / "other"
    key.write_text("k" * 32)
    other.write_text("o" * 32)
    bundle = tmp_path / "signed"
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.export", minilm_artifact, "--bundle", bundle],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ARTIFACT_SIGNING_KEY": str(key)},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((bundle / MANIFEST).read_text())["integrity"]["signature"]["scheme"] == "hmac-sha256"
    ran = run_bundle(bundle_python, bundle, "hello", "--key", str(key), "--require-signature", cwd=tmp_path)
    assert ran.returncode == 0 and len(json.loads(ran.stdout)) == 384, ran.stderr
    one_error_line(run_bundle(bundle_python, bundle, "hello", "--key", str(other), cwd=tmp_path), "signature")


def test_a_graph_the_ort_converter_cannot_take_is_refused_with_one_line(minilm_artifact, tmp_path):
    """A sentence-encoder artifact (sealed as the pipeline seals one) whose graph uses an operator of a
    domain ONNX Runtime does not have: its converter fails, and export says so in one line."""
    import onnx
    from onnx import TensorProto, helper

    artifact = tmp_path / "custom-op"
    with staging(artifact) as stage:
        node = helper.make_node("Embed", ["input_ids"], ["sentence_embedding"], domain="com.example")
        graph = helper.make_graph(
            [node],
            "custom",
            [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
            [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", 4])],
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)]
        )
        onnx.save(model, stage / "model.onnx")
        shutil.copytree(minilm_artifact / "tokenizer", stage / "tokenizer")
        write_manifest(
            stage,
            {
                "id": "custom-op-test",
                "engine": {
                    "format": "onnxruntime",
                    "file": "model.onnx",
                    "task": "sentence_embedding",
                    "tokenizer": "tokenizer",
                },
                "gate": {"passed": True, "checks": []},
                "verdict": "passed",
            },
        )
        publish(stage, artifact)
    proc = export(artifact, "--bundle", tmp_path / "bundle", "--ort-format")
    one_error_line(proc, "model.onnx: ONNX Runtime cannot convert it to ORT format")
    assert not (tmp_path / "bundle").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
