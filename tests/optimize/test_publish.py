"""Publishing to model registries with the real libraries: MLflow against its embedded SQLite store and
against a real `mlflow server` on loopback (read back with MLflow's own client), the Hugging Face Hub up to
the upload (card, file selection, dry run, refusal without network or token), and every refusal (exit 2,
one line, nothing published)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engines.artifact import read_manifest, verify
from tests.support.cli import ROOT, one_error_line

mlflow = pytest.importorskip("mlflow")
huggingface_hub = pytest.importorskip("huggingface_hub")


def publish_cli(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimize.publish", *map(str, args)],
        cwd=cwd,
        env=dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def artifact_copy(minilm_artifact, tmp_path) -> Path:
    """The session's passing artifact, copied so the default store (beside it) starts empty."""
    return Path(shutil.copytree(minilm_artifact, tmp_path / "out" / "artifact"))


def _check_version(uri: str, name: str, version: str, manifest: dict, tmp_path: Path) -> None:
    """What MLflow's own client reads back: tags, params, metrics, and the artifact files (intact)."""
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    found = client.get_model_version(name, version)
    assert found.tags["verdict"] == manifest["verdict"]
    assert found.tags["manifest_id"] == manifest["id"]
    assert found.tags["parent_id"] == str(manifest["parent_id"])
    assert found.tags["manifest_digest"] == manifest["integrity"]["digest"]
    assert (found.tags["engine"], found.tags["precision"], found.tags["device"]) == ("onnxruntime", "int8", "cpu")
    run = client.get_run(found.run_id)
    assert run.data.params["quantize.method"] == "ort_int8_dynamic"
    assert run.data.params["evaluate.batch_sizes"] == "[1, 32]"
    assert run.data.params["gate.min_cosine"] == str(manifest["recipe"]["resolved"]["gate"]["min_cosine"])
    for check in manifest["gate"]["checks"]:
        assert run.data.metrics[f"gate.{check['name']}.value"] == pytest.approx(check["value"])
        assert run.data.metrics[f"gate.{check['name']}.threshold"] == pytest.approx(check["threshold"])
        assert run.data.metrics[f"gate.{check['name']}.passed"] == float(check["passed"])
    fidelity = manifest["metrics"]["candidate"]["fidelity"]
    assert run.data.metrics["candidate.fidelity.cosine_min"] == pytest.approx(fidelity["cosine_min"])
    top = {f.path for f in client.list_artifacts(found.run_id)}
    assert {"artifact", "manifest.json", "report.md", "junit.xml"} <= top
    source = client.get_model_version_download_uri(name, version)
    downloaded = mlflow.artifacts.download_artifacts(source, dst_path=str(tmp_path / "download"), tracking_uri=uri)
    assert read_manifest(downloaded)["id"] == manifest["id"]
    assert verify(downloaded) == []  # every file came back as the manifest lists it


def test_publish_registers_a_version_in_the_embedded_store(artifact_copy, tmp_path):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    proc = publish_cli(artifact_copy, "--to", "mlflow", "--model-name", "minilm-int8", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "published to MLflow" in proc.stdout and "model minilm-int8 version 1" in proc.stdout
    assert proc.stderr.strip() == ""  # MLflow's store-creation logging stays quiet
    store = artifact_copy.parent / "mlruns"
    _check_version(f"sqlite:///{store / 'mlflow.db'}", "minilm-int8", "1", read_manifest(artifact_copy), tmp_path)
    assert (store / "artifacts").is_dir()  # the files live beside the store, not in the working folder
    assert list(elsewhere.iterdir()) == []  # no mlflow.db or mlruns/ where the command ran
    again = publish_cli(artifact_copy, "--to", "mlflow", "--model-name", "minilm-int8")
    assert "version 2" in again.stdout, again.stderr[-2000:]


def test_publish_at_the_end_of_a_run_tags_a_failed_gate(failed_gate_run, tmp_path):
    assert "published to MLflow" in failed_gate_run.proc.stdout
    manifest = read_manifest(failed_gate_run.artifact)
    client = mlflow.MlflowClient(f"sqlite:///{failed_gate_run.artifact.parent / 'mlruns' / 'mlflow.db'}")
    (version,) = client.search_model_versions("name='minilm_int8_cpu'")
    assert version.tags["verdict"] == "failed" and version.tags["manifest_id"] == manifest["id"]
    run = client.get_run(version.run_id)
    assert run.data.metrics["gate.min_cosine.passed"] == 0.0 and run.data.metrics["gate.passed"] == 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on loopback with its own SQLite store and artifact folder; always stopped."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its workers in one process group, stopped together
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        yield url, tmp_path / "server-artifacts"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def test_publish_to_a_real_mlflow_server(minilm_artifact, mlflow_server, tmp_path):
    url, server_files = mlflow_server
    proc = publish_cli(minilm_artifact, "--to", "mlflow", "--tracking-uri", url, "--experiment", "ci")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"published to MLflow {url}: model minilm_int8_cpu version 1" in proc.stdout
    assert mlflow.MlflowClient(tracking_uri=url).get_experiment_by_name("ci") is not None
    _check_version(url, "minilm_int8_cpu", "1", read_manifest(minilm_artifact), tmp_path)
    assert any(p.name == "model.onnx" for p in server_files.rglob("*"))  # the server stored the files
    assert not (minilm_artifact.parent / "mlruns").exists()  # nothing went to the default store


# --- refusals: exit 2, one line, nothing published ---------------------------------------------------


def _nothing_published(artifact: Path) -> None:
    assert not (artifact.parent / "mlruns").exists()


def test_no_such_artifact(tmp_path):
    proc = publish_cli(tmp_path / "missing", "--to", "mlflow")
    one_error_line(proc, "missing", "not a directory")
    assert not (tmp_path / "mlruns").exists()


def test_a_tampered_artifact_is_refused(artifact_copy):
    vocab = next(p for p in (artifact_copy / "tokenizer").iterdir() if p.is_file())
    vocab.write_bytes(vocab.read_bytes() + b"\n")
    proc = publish_cli(artifact_copy, "--to", "mlflow")
    one_error_line(proc, "does not match its manifest", f"changed file tokenizer/{vocab.name}", "refusing to publish")
    _nothing_published(artifact_copy)


def test_an_edited_manifest_is_refused(artifact_copy):
    manifest = artifact_copy / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"verdict": "passed"', '"verdict": "failed"'))
    one_error_line(publish_cli(artifact_copy, "--to", "mlflow", "--allow-failed"), "modified after it was written")
    _nothing_published(artifact_copy)


def test_a_failed_gate_is_refused_unless_allowed(failed_gate_run, tmp_path):
    copy = Path(shutil.copytree(failed_gate_run.artifact, tmp_path / "out" / "artifact"))
    proc = publish_cli(copy, "--to", "mlflow")
    one_error_line(proc, "the gate failed (min_cosine)", "--allow-failed")
    _nothing_published(copy)


def test_an_unreachable_tracking_uri_is_refused(artifact_copy):
    port = _free_port()  # nothing listens there
    proc = publish_cli(artifact_copy, "--to", "mlflow", "--tracking-uri", f"http://127.0.0.1:{port}")
    one_error_line(proc, f"http://127.0.0.1:{port} is unreachable", "nothing published")
    _nothing_published(artifact_copy)


def test_an_unknown_registry_and_missing_settings_are_refused(artifact_copy, tmp_path):
    one_error_line(publish_cli(artifact_copy, "--to", "s3"), "invalid choice")
    one_error_line(publish_cli(artifact_copy, "--to", "hf_hub"), "publish.repo_id is required")
    one_error_line(publish_cli(artifact_copy, "--to", "hf_hub", "--repo-id", "a/b/c"), "repo_id=a/b/c")
    # The same settings at the end of a run are refused before the run starts.
    from tests.support.cli import run_optimize

    proc = run_optimize("publish=hf_hub", f"output_dir={tmp_path / 'run-out'}")
    one_error_line(proc, "publish.repo_id is required")
    proc = run_optimize("publish=mlflow", "publish.tracking_uri=http://127.0.0.1:9", f"output_dir={tmp_path / 'o'}")
    one_error_line(proc, "unreachable")
    assert not (tmp_path / "run-out").exists() and not (tmp_path / "o").exists()


# --- the Hugging Face Hub, up to the upload ----------------------------------------------------------


def test_hub_dry_run_lists_the_card_and_the_manifest_files(artifact_copy, tmp_path):
    folder = tmp_path / "repo"
    proc = publish_cli(
        artifact_copy, "--to", "hf_hub", "--repo-id", "acme/minilm-int8", "--dry-run", "--folder", folder
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = read_manifest(artifact_copy)
    expected = {"README.md", "artifact/manifest.json", *(f"artifact/{f['path']}" for f in manifest["files"])}
    listed = {line.split("  ")[0] for line in proc.stdout.splitlines()[:-1]}
    assert listed == expected == {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert proc.stdout.splitlines()[-1].startswith(f"dry run: {len(expected)} files")
    assert "would go to acme/minilm-int8" in proc.stdout
    assert verify(folder / "artifact") == []  # a downloaded copy verifies as it is

    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.pipeline_tag == "sentence-similarity" and card.data.library_name == "onnx"
    assert {"optimize", "onnxruntime", "int8", "cpu", "gate-passed"} <= set(card.data.tags)
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results == {c["name"]: pytest.approx(c["value"], abs=1e-6) for c in manifest["gate"]["checks"]}
    assert card.data.optimize["manifest_id"] == manifest["id"]
    assert card.data.optimize["parent_id"] == str(manifest["parent_id"])
    assert "python -m serve model/artifact" in card.text
    assert "| check | metric | value | threshold | result |" in card.text


def test_hub_dry_run_without_a_folder_leaves_nothing(artifact_copy, tmp_path):
    env = {"TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    proc = publish_cli(artifact_copy, "--to", "hf_hub", "--repo-id", "acme/minilm", "--dry-run", env=env)
    assert proc.returncode == 0 and "(nothing written)" in proc.stdout, proc.stderr[-2000:]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_hub_upload_without_network_or_token_is_one_line(artifact_copy, tmp_path):
    offline = publish_cli(artifact_copy, "--to", "hf_hub", "--repo-id", "acme/minilm", env={"HF_HUB_OFFLINE": "1"})
    one_error_line(offline, "cannot upload to acme/minilm", "offline")
    no_token = {"HF_HUB_OFFLINE": "0", "HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf-home")}
    proc = publish_cli(artifact_copy, "--to", "hf_hub", "--repo-id", "acme/minilm", env=no_token)
    one_error_line(proc, "no Hugging Face token")


def test_a_failed_gate_is_not_published_at_the_end_of_a_run_unless_allowed(failed_gate_run, tmp_path, capsys):
    from omegaconf import OmegaConf

    from optimize.__main__ import _publish

    copy = Path(shutil.copytree(failed_gate_run.artifact, tmp_path / "out" / "artifact"))
    cfg = OmegaConf.create({"publish": {"to": "mlflow", "allow_failed": False}})
    _publish(cfg, read_manifest(copy), copy)
    assert "not published to mlflow: the gate failed" in capsys.readouterr().out
    _nothing_published(copy)
