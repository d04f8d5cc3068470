"""Edge and laptop bundles (`python -m optimize.export ARTIFACT --bundle DIR`): run in a fresh virtual
environment that has only the bundle's three packages, embed exactly as the server does, refuse
changed files, and refuse bad inputs with one line and nothing written."""

from __future__ import annotations

import ast
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
# The checker package, as a bundle carries it: artifact/__init__.py and its modules.
CHECKER = {f"artifact/{p.name}": p for p in sorted((ROOT / "engines" / "artifact").glob("*.py"))}


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
    from serve.encoder.model import EncoderModel

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
    # The checker in the bundle is the project's checker package, file for file and byte for byte, and
    # every file of it is listed in the manifest.
    assert "artifact/__init__.py" in CHECKER and len(CHECKER) > 1
    assert sorted(p.name for p in (ort / "artifact").iterdir()) == sorted(Path(rel).name for rel in CHECKER)
    assert all((ort / rel).read_bytes() == path.read_bytes() for rel, path in CHECKER.items())
    listed = {f["path"] for f in manifest["files"]}
    tokenizer = {f["path"] for f in source["files"] if f["path"].startswith("tokenizer/")}
    bundle_files = {
        "run.py",
        "runtimes.py",
        "requirements.txt",
        "model.ort",
        "model.required_operators.config",
        *CHECKER,
    }
    assert listed == bundle_files | tokenizer
    # run.py needs nothing from this project; the checker's modules, the standard library and each other
    # (relatively: run.py loads the package by its path).
    for script in ("run.py", "runtimes.py"):
        source_code = (ort / script).read_text()
        assert not any(
            f"import {m}" in source_code or f"from {m}" in source_code for m in ("optimize", "engines", "torch")
        )
    for rel in CHECKER:
        imported = set()
        for node in ast.walk(ast.parse((ort / rel).read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(str(node.module).split(".")[0])
        assert imported <= sys.stdlib_module_names, (rel, imported - sys.stdlib_module_names)


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


@pytest.mark.parametrize("model_file", ["artifact/model.ort", "artifact"])
def test_an_artifact_with_files_named_like_the_bundles_checker_is_refused(model_file, tmp_path):
    """The bundle writes its checker package to artifact/: an artifact file there (or a file named
    artifact) is refused, as one named run.py or requirements.txt is, before anything is written."""
    artifact = tmp_path / "clash"
    with staging(artifact) as stage:
        (stage / model_file).parent.mkdir(parents=True, exist_ok=True)
        (stage / model_file).write_bytes(b"not read")
        (stage / "tokenizer").mkdir()
        (stage / "tokenizer" / "tokenizer.json").write_text("{}")
        engine = {"format": "onnxruntime", "file": model_file, "task": "sentence_embedding", "tokenizer": "tokenizer"}
        write_manifest(
            stage,
            {"id": "clash-test", "engine": engine, "gate": {"passed": True, "checks": []}, "verdict": "passed"},
        )
        publish(stage, artifact)
    one_error_line(export(artifact, "--bundle", tmp_path / "bundle"), "named like the bundle's own", model_file)
    assert not (tmp_path / "bundle").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


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
    from engines.onnxruntime_genai.runner import Sampling

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
    assert {xml, xml[: -len(".xml")] + ".bin", "run.py", "runtimes.py", "requirements.txt", *CHECKER} <= listed
    assert all(
        p.startswith("tokenizer/")
        for p in listed - {xml, xml[:-4] + ".bin", "run.py", "runtimes.py", "requirements.txt", *CHECKER}
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


# --- hostile inputs to a bundle's run.py --------------------------------------------------------------

PERMISSIVE_CHECKER = '''"""A replaced checker that passes every bundle."""
import json
from pathlib import Path


class ArtifactError(Exception):
    pass


def read_key(path):
    return b"any key will do"


def verify(root, key=None, require_signature=False):
    return []


def read_manifest(root):
    return json.loads((Path(root) / "manifest.json").read_text())


parse_json = json.loads
'''


def copy_bundle(bundle: Path, to: Path) -> Path:
    shutil.copytree(bundle, to)
    return to


def run_raw(python: Path, *args, cwd: Path, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    """A command whose arguments and stdin may hold bytes that are not UTF-8 (as surrogate escapes)."""
    return subprocess.run(
        [python, *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        encoding="utf-8",
        errors="surrogateescape",
        env=env,
    )


def test_modules_planted_in_a_bundle_never_run(bundles, bundle_python, tmp_path):
    """`python run.py` puts the bundle's folder first on the module path: a numpy.py, argparse.py or
    __future__.py added there must not run before (or after) the bundle is refused."""
    planted = copy_bundle(bundles["onnx"], tmp_path / "planted")
    names = ["numpy", "argparse", "__future__", "json", "tempfile", "pathlib", "typing", "os", "hashlib", "importlib"]
    for name in names:
        (planted / f"{name}.py").write_text(f"open({str(tmp_path / ('ran-' + name))!r}, 'w').close()\n")
    project_python = Path(sys.executable)
    runs = [
        (bundle_python, tmp_path, None),  # docs/bundles.md's command: no -I
        (bundle_python, planted, {**os.environ, "PYTHONPATH": "."}),  # from inside, the folder on PYTHONPATH
        (project_python, tmp_path, None),  # with the project installed
    ]
    for python, cwd, env in runs:
        proc = run_raw(python, planted / "run.py", "hello", cwd=cwd, env=env)
        one_error_line(proc, "does not match its manifest", "unexpected file")
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ran-")], python


def test_a_bundle_whose_checker_is_incomplete_or_damaged_is_refused_with_one_line(bundles, bundle_python, tmp_path):
    """run.py loads the checker package by its path: without the project (the fresh environment, -I) a
    missing or damaged file of the bundle's artifact/ is one line and exit 2, naming the file; with the
    project installed, its own checker finds the bundle's copy short of a file like any other."""
    project_python = Path(sys.executable)
    missing_module = copy_bundle(bundles["onnx"], tmp_path / "missing-module")
    (missing_module / "artifact" / "files.py").unlink()
    one_error_line(
        run_bundle(bundle_python, missing_module, "hello", cwd=tmp_path), "artifact/files.py (the checker) is missing"
    )
    one_error_line(
        run_raw(project_python, missing_module / "run.py", "hello", cwd=tmp_path),
        "does not match its manifest",
        "missing file artifact/files.py",
    )
    no_init = copy_bundle(bundles["onnx"], tmp_path / "no-init")
    (no_init / "artifact" / "__init__.py").unlink()
    one_error_line(
        run_bundle(bundle_python, no_init, "hello", cwd=tmp_path), "artifact/__init__.py (the checker) is missing"
    )
    no_checker = copy_bundle(bundles["onnx"], tmp_path / "no-checker")
    shutil.rmtree(no_checker / "artifact")
    one_error_line(run_bundle(bundle_python, no_checker, "hello", cwd=tmp_path), "artifact/ (the checker) is missing")
    damaged = copy_bundle(bundles["onnx"], tmp_path / "damaged")
    with open(damaged / "artifact" / "integrity.py", "a") as f:
        f.write("\ndef truncated(\n")
    one_error_line(
        run_bundle(bundle_python, damaged, "hello", cwd=tmp_path), "the checker cannot be loaded", "SyntaxError"
    )
    # Running them wrote nothing into them (no __pycache__ beside the checker's modules).
    for bundle in (missing_module, no_init, no_checker, damaged):
        assert not [p for p in bundle.rglob("__pycache__")], bundle


def test_modules_planted_in_the_bundles_checker_folder_never_run(bundles, bundle_python, tmp_path):
    """The checker's own imports are relative: a json.py or hashlib.py added to artifact/ is not what
    its `import json` finds, and the bundle is refused for the added file."""
    planted = copy_bundle(bundles["onnx"], tmp_path / "planted")
    names = ["json", "hashlib", "hmac", "os", "re", "stat", "mmap", "pathlib", "engines", "bundle_artifact_checker"]
    for name in names:
        (planted / "artifact" / f"{name}.py").write_text(f"open({str(tmp_path / ('ran-' + name))!r}, 'w').close()\n")
    for python in (bundle_python, Path(sys.executable)):
        proc = run_raw(python, planted / "run.py", "hello", cwd=tmp_path)
        one_error_line(proc, "does not match its manifest", "unexpected file artifact/")
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ran-")], python


@pytest.fixture(scope="module")
def signed_bundle(minilm_artifact, tmp_path_factory) -> tuple[Path, Path]:
    """A bundle signed with the key it returns."""
    root = tmp_path_factory.mktemp("signed")
    key = root / "key"
    key.write_text("k" * 32)
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.export", minilm_artifact, "--bundle", root / "bundle"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ARTIFACT_SIGNING_KEY": str(key)},
    )
    assert proc.returncode == 0, proc.stderr
    return root / "bundle", key


def verify_bundle(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimize.verify", bundle, *args], cwd=ROOT, capture_output=True, text=True
    )


def test_a_replaced_checker_is_caught_by_verify_and_by_run_py_where_the_project_is_installed(signed_bundle, tmp_path):
    """A bundle cannot vouch for itself: its run.py checks with its own artifact/, which whoever edits
    the bundle can replace. The checker from outside the bundle (`optimize.verify`, or the installed
    project's, which run.py uses when this Python has the project) catches the replaced file."""
    signed, key = signed_bundle
    tampered = copy_bundle(signed, tmp_path / "tampered")
    (tampered / "artifact" / "__init__.py").write_text(PERMISSIVE_CHECKER)
    (tampered / "tokenizer" / "tokenizer.json").write_bytes(b"{}")
    verified = verify_bundle(tampered, "--key", str(key), "--require-signature")
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert "changed file artifact/__init__.py" in verified.stdout, verified.stdout
    assert "changed file tokenizer/tokenizer.json" in verified.stdout
    ran = run_raw(Path(sys.executable), tampered / "run.py", "hello", "--key", key, "--require-signature", cwd=tmp_path)
    one_error_line(ran, "does not match its manifest", "changed file")
    # An unsigned bundle whose manifest was rewritten to match: only a signature catches that, and
    # verify says the bundle's checker is not this project's.
    resealed = tmp_path / "resealed"
    with staging(resealed) as stage:
        shutil.copytree(signed, stage, dirs_exist_ok=True)
        (stage / "artifact" / "__init__.py").write_text(PERMISSIVE_CHECKER)
        body = {k: v for k, v in json.loads((stage / MANIFEST).read_text()).items() if k != "integrity"}
        (stage / MANIFEST).unlink()
        write_manifest(stage, body)
        publish(stage, resealed)
    one_error_line(verify_bundle(resealed, "--key", str(key), "--require-signature"), "not signed")
    plain = verify_bundle(resealed)
    assert plain.returncode == 0 and "artifact/ is not this project's checker" in plain.stdout, plain.stdout
    assert "not this project's checker" not in verify_bundle(signed).stdout
    # run.py --help says so.
    helped = run_raw(Path(sys.executable), signed / "run.py", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "python -m optimize.verify" in helped.stdout
    assert "not tampering" in " ".join(helped.stdout.split())


def test_text_that_is_not_utf8_is_one_line(bundles, bundle_python, tmp_path):
    run = bundles["onnx"] / "run.py"
    one_error_line(run_raw(bundle_python, "-I", run, "fine", "bad \udcff text", cwd=tmp_path), "argument 2", "UTF-8")
    one_error_line(run_raw(bundle_python, "-I", run, cwd=tmp_path, stdin="ok\nbad \udcfe\n"), "stdin", "UTF-8")
    assert verify_bundle(bundles["onnx"]).returncode == 0


def test_a_bad_output_is_refused_before_anything_is_computed(bundles, bundle_python, tmp_path):
    """An --output that is a folder, in a folder that cannot be written, or inside the bundle (which would
    then refuse every later run) is one line; stdin that is not UTF-8 is not even read."""
    bundle = bundles["onnx"]
    (tmp_path / "folder.npy").mkdir()
    (tmp_path / "into-bundle").symlink_to(bundle / "tokenizer")
    cases = {
        tmp_path / "folder.npy": "is a folder",
        Path("/proc/no-such-dir/x.npy"): "existing folder",
        Path("/proc/x.npy"): "cannot write",
        bundle / "vectors.npy": "inside the bundle",
        bundle / "tokenizer" / "vectors.npy": "inside the bundle",
        tmp_path / "into-bundle" / "vectors.npy": "inside the bundle",
        tmp_path / "vectors.json": "give a .npy file",
    }
    for output, fragment in cases.items():
        proc = run_raw(bundle_python, "-I", bundle / "run.py", "--output", output, cwd=tmp_path, stdin="\udcff\n")
        one_error_line(proc, f"--output {output}", fragment)
    assert verify_bundle(bundle).returncode == 0  # nothing was written into it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.npy", "into-bundle"]
    assert list((tmp_path / "folder.npy").iterdir()) == []


def test_a_manifest_with_a_huge_integer_is_one_line(bundles, bundle_python, tmp_path):
    """Python's json refuses integers over 4300 digits with a ValueError; the checker says so in one line."""
    huge = copy_bundle(bundles["onnx"], tmp_path / "huge")
    text = (huge / MANIFEST).read_text()
    (huge / MANIFEST).write_text(text.replace("{", '{"count": ' + "9" * 5000 + ",", 1))
    one_error_line(run_bundle(bundle_python, huge, "hello", cwd=tmp_path), "manifest.json", "integer")
    one_error_line(run_raw(Path(sys.executable), huge / "run.py", "hello", cwd=tmp_path), "manifest.json", "integer")
    one_error_line(verify_bundle(huge), "manifest.json", "integer")
    one_error_line(export(huge, "--bundle", tmp_path / "again"), "manifest.json", "integer")


def test_a_causal_lm_bundle_refuses_bad_text_and_output_with_one_line(tiny_llm, tmp_path):
    """The same refusals for a causal-LM bundle, before onnxruntime-genai loads anything."""
    bundle = tmp_path / "bundle"
    assert export(tiny_llm, "--bundle", bundle).returncode == 0
    python, run = Path(sys.executable), bundle / "run.py"
    one_error_line(run_raw(python, "-I", run, "\udcc3", cwd=tmp_path), "argument 1", "UTF-8")
    one_error_line(run_raw(python, "-I", run, cwd=tmp_path, stdin="\udcff"), "stdin", "UTF-8")
    (tmp_path / "folder.json").mkdir()
    one_error_line(run_raw(python, "-I", run, "hi", "--output", tmp_path / "folder.json", cwd=tmp_path), "folder")
    one_error_line(run_raw(python, "-I", run, "hi", "--output", bundle / "out.json", cwd=tmp_path), "inside the bundle")
    one_error_line(run_raw(python, "-I", run, "hi", "--output", tmp_path / "out.npy", cwd=tmp_path), "give a .json")
    assert verify_bundle(bundle).returncode == 0
