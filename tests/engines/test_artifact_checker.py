"""The artifact checker verify and serve share (engines/artifact/), against hostile artifacts.

Findings 1 (paths leaving the artifact), 2 (manifest integrity and signatures), 11 (links and special
files) and 12 (malformed manifests). Every hostile file is made here; an attacker who edits a manifest
is assumed to recompute its unkeyed digest (`reseal`), so what stops them is the path and entry checks,
or a signature.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import engines
from engines.artifact import (
    ArtifactError,
    check_onnx_external_data,
    read_key,
    read_manifest,
    seal,
    sha256_file,
    verify,
)
from optimize import artifact
from tests.support.cli import ROOT, one_error_line

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402


def tiny_onnx(path: Path, negate: bool = False, external: str | None = None) -> Path:
    """y = x + w (w = 0), or -(x + w): a graph whose outputs tell which file was run. With `external`,
    w is stored as external data at that location (relative to the graph's folder)."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4], [0.0] * 4)
    nodes = [
        helper.make_node("Add", ["x", "w"], ["s"]),
        helper.make_node("Neg" if negate else "Identity", ["s"], ["sentence_embedding"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if external is not None:
        weight = model.graph.initializer[0]
        weight.ClearField("float_data")
        weight.data_location = TensorProto.EXTERNAL
        for key, value in (("location", external), ("offset", "0"), ("length", "16")):
            entry = weight.external_data.add()
            entry.key, entry.value = key, value
    path.write_bytes(model.SerializeToString())
    return path


def build(tmp_path: Path, passed: bool = True, key_file: Path | None = None, name: str = "artifact") -> Path:
    final = tmp_path / name
    env_before = os.environ.get("ARTIFACT_SIGNING_KEY")
    if key_file:
        os.environ["ARTIFACT_SIGNING_KEY"] = str(key_file)
    try:
        with artifact.staging(final) as stage:
            tiny_onnx(stage / "model.onnx")
            (stage / "notes.txt").write_text("hello")
            artifact.write_manifest(
                stage,
                {
                    "engine": {"format": "onnxruntime", "file": "model.onnx", "task": "sentence_embedding"},
                    "metrics": {"candidate": {"cosine": 0.5}},
                    "gate": {"passed": passed, "checks": [{"name": "min_cosine", "passed": passed}]},
                    "verdict": "passed" if passed else "failed",
                },
            )
            artifact.publish(stage, final)
    finally:
        if key_file:
            if env_before is None:
                os.environ.pop("ARTIFACT_SIGNING_KEY")
            else:
                os.environ["ARTIFACT_SIGNING_KEY"] = env_before
    return final


def edit(root: Path, change, keep_signature: bool = False) -> None:
    """Edit the manifest as an attacker would: change it, recompute the unkeyed digest."""
    manifest = json.loads((root / "manifest.json").read_text())
    signature = manifest["integrity"].get("signature")
    change(manifest)
    manifest = seal(manifest)
    if keep_signature and signature:
        manifest["integrity"]["signature"] = signature
    (root / "manifest.json").write_text(json.dumps(manifest))


def cli(*args: str, env: dict | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def verify_cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return cli("-m", "optimize.verify", str(root), *args, env=env)


def serve_cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return cli("-m", "serve", str(root), "--port", "0", *args, env=env)


X = {"x": np.ones((2, 4), dtype=np.float32)}


# --- finding 1: every path stays inside the artifact ----------------------------------------------


@pytest.mark.parametrize("where", ["../outside.onnx", "ABSOLUTE", "./../outside.onnx", "sub/../../outside.onnx"])
def test_engine_file_outside_the_artifact_is_refused(tmp_path, where):
    root = build(tmp_path)
    outside = tiny_onnx(tmp_path / "outside.onnx", negate=True)
    path = str(outside) if where == "ABSOLUTE" else where
    edit(root, lambda m: m["engine"].update(file=path))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        engines.load(root)
    one_error_line(verify_cli(root), "engine.file", "outside the artifact")
    one_error_line(serve_cli(root), "outside the artifact")


def test_load_engine_refuses_an_outside_file_even_without_a_manifest(tmp_path):
    root = build(tmp_path)
    tiny_onnx(tmp_path / "outside.onnx", negate=True)
    with pytest.raises(ArtifactError, match="outside the artifact"):
        engines.load_engine(root, {"format": "onnxruntime", "file": "../outside.onnx"})
    assert np.allclose(engines.load(root)(X)["sentence_embedding"], 1.0)  # the artifact's own graph


def test_engine_file_through_a_symlinked_folder_is_refused(tmp_path):
    root = build(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tiny_onnx(elsewhere / "model.onnx", negate=True)
    (root / "sub").symlink_to(elsewhere, target_is_directory=True)
    edit(root, lambda m: m["engine"].update(file="sub/model.onnx"))
    with pytest.raises(ArtifactError, match="symbolic link"):
        engines.load_engine(root, {"format": "onnxruntime", "file": "sub/model.onnx"})
    one_error_line(verify_cli(root), "symbolic link")


def test_files_path_outside_is_refused(tmp_path):
    root = build(tmp_path)
    (tmp_path / "secret.txt").write_text("x")
    sha = sha256_file(tmp_path / "secret.txt")
    edit(root, lambda m: m["files"].append({"path": "../secret.txt", "bytes": 1, "sha256": sha}))
    one_error_line(verify_cli(root), "files[2].path", "outside the artifact")


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/hostname", "sub/../../secret.bin"])
def test_onnx_external_data_outside_is_refused_before_onnxruntime_opens_it(tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(np.full(4, 7.0, np.float32).tobytes())
    root = build(tmp_path)
    tiny_onnx(root / "model.onnx", external=location)
    sha = sha256_file(root / "model.onnx")
    edit(root, lambda m: m["files"][0].update(sha256=sha))
    with pytest.raises(ArtifactError, match="external data"):
        engines.load(root)
    one_error_line(verify_cli(root), "external data")


def test_external_data_in_a_subgraph_is_found(tmp_path):
    """The project's own protobuf reader finds external tensors in If/Loop bodies too."""
    inner = tiny_onnx(tmp_path / "inner.onnx", external="../x.bin")
    body = onnx.load(str(inner), load_external_data=False).graph
    node = helper.make_node("If", ["c"], ["sentence_embedding"], then_branch=body, else_branch=body)
    graph = helper.make_graph(
        [node],
        "outer",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, None)],
    )
    (tmp_path / "outer.onnx").write_bytes(helper.make_model(graph).SerializeToString())
    with pytest.raises(ArtifactError, match="outside the artifact"):
        check_onnx_external_data(tmp_path / "outer.onnx")


# --- finding 2: the manifest cannot be edited ------------------------------------------------------


def test_flipping_the_gate_is_refused(tmp_path):
    root = build(tmp_path, passed=False)
    one_error_line(serve_cli(root), "gate did not pass")
    text = (root / "manifest.json").read_text().replace('"passed": false', '"passed": true')
    (root / "manifest.json").write_text(text)
    with pytest.raises(ArtifactError, match="modified after it was written"):
        read_manifest(root)
    one_error_line(verify_cli(root), "modified after it was written")
    one_error_line(serve_cli(root, "--allow-modified"), "modified after it was written")


def test_edited_metrics_fail_verify(tmp_path):
    root = build(tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["metrics"]["candidate"]["cosine"] = 0.9999
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    one_error_line(verify_cli(root), "digest does not match")


def test_signed_manifest(tmp_path):
    key, other = tmp_path / "key", tmp_path / "other"
    key.write_text("a-sixteen-byte-plus-secret\n")
    other.write_text("another-secret-of-enough-bytes")
    root = build(tmp_path, passed=False, key_file=key)
    ok = verify_cli(root, "--key", str(key))
    assert ok.returncode == 0 and "signed (hmac-sha256" in ok.stdout, ok.stderr
    assert "signature not checked" in verify_cli(root).stdout
    one_error_line(verify_cli(root, "--key", str(other)), "signature does not match")
    one_error_line(verify_cli(root, env={"ARTIFACT_VERIFY_KEY": str(other)}), "signature does not match")
    # The attacker flips the gate and recomputes the digest: the old signature no longer matches...
    edit(root, lambda m: m["gate"].update(passed=True), keep_signature=True)
    one_error_line(verify_cli(root, "--key", str(key)), "signature does not match")
    one_error_line(serve_cli(root, "--key", str(key)), "signature does not match")
    # ...and dropping it leaves an unsigned manifest, which a server told to require signatures refuses.
    edit(root, lambda m: None)
    one_error_line(serve_cli(root, "--key", str(key), "--require-signature"), "not signed")
    one_error_line(verify_cli(root, "--require-signature"), "not signed")


def test_unsigned_artifacts_load_unless_signatures_are_required(tmp_path):
    key = tmp_path / "key"
    key.write_text("a-sixteen-byte-plus-secret")
    root = build(tmp_path)
    assert verify_cli(root, "--key", str(key)).returncode == 0
    one_error_line(verify_cli(root, "--key", str(key), "--require-signature"), "not signed")


def test_short_or_pem_keys_are_refused(tmp_path):
    root = build(tmp_path)
    (tmp_path / "short").write_text("abc")
    (tmp_path / "pem").write_text("-----BEGIN PRIVATE KEY-----\nxx\n-----END PRIVATE KEY-----\n")
    one_error_line(verify_cli(root, "--key", str(tmp_path / "short")), "at least 16 bytes")
    one_error_line(verify_cli(root, "--key", str(tmp_path / "pem")), "Ed25519")
    one_error_line(verify_cli(root, "--key", str(tmp_path / "missing")), "key file")


def test_key_files_that_are_not_small_regular_files_are_refused_without_blocking(tmp_path):
    """/dev/zero would be read forever and a FIFO blocks until a writer comes: both are refused."""
    root = build(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "huge").write_bytes(b"k" * (1 << 20))
    for key, fragment in (("/dev/zero", "character device"), (str(tmp_path / "fifo"), "FIFO"), (str(tmp_path), "")):
        with pytest.raises(ArtifactError, match=fragment):
            read_key(key)
        one_error_line(verify_cli(root, "--key", key), "key file")
    one_error_line(verify_cli(root, "--key", str(tmp_path / "huge")), "key file", "over")
    one_error_line(serve_cli(root, "--key", "/dev/zero"), "key file", "character device")


# --- finding 11: links and special files ------------------------------------------------------------


def test_fifo_in_the_artifact_is_refused_without_blocking(tmp_path):
    root = build(tmp_path)
    os.mkfifo(root / "pipe")
    one_error_line(verify_cli(root), "pipe is a FIFO")


def test_symlinked_directory_is_refused(tmp_path):
    root = build(tmp_path)
    (tmp_path / "d").mkdir()
    (root / "linked").symlink_to(tmp_path / "d", target_is_directory=True)
    one_error_line(verify_cli(root), "linked is a symbolic link")


def test_symlink_with_matching_content_is_refused(tmp_path):
    root = build(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")  # same content as the artifact's file
    (root / "notes.txt").unlink()
    (root / "notes.txt").symlink_to(tmp_path / "notes.txt")
    one_error_line(verify_cli(root), "notes.txt is a symbolic link")
    one_error_line(serve_cli(root, "--allow-modified"), "symbolic link")


def test_symlinked_manifest_is_refused(tmp_path):
    root = build(tmp_path)
    os.replace(root / "manifest.json", tmp_path / "m.json")
    (root / "manifest.json").symlink_to(tmp_path / "m.json")
    one_error_line(verify_cli(root), "manifest.json is a symbolic link")


def test_hard_links_are_refused(tmp_path):
    root = build(tmp_path)
    os.link(root / "notes.txt", tmp_path / "alias.txt")
    one_error_line(verify_cli(root), "notes.txt is a hard link")


def test_hard_linked_external_data_is_refused_before_onnxruntime_reads_it(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(np.full(4, 7.0, np.float32).tobytes())
    os.link(tmp_path / "secret.bin", folder / "w.bin")
    tiny_onnx(folder / "model.onnx", external="w.bin")
    with pytest.raises(ArtifactError, match="hard link"):
        engines.load_engine(folder, {"format": "onnxruntime", "file": "model.onnx"})
    os.unlink(tmp_path / "secret.bin")  # a single link now: accepted, and the weights are read
    out = engines.load_engine(folder, {"format": "onnxruntime", "file": "model.onnx"})(X)
    assert np.allclose(out["sentence_embedding"], 8.0)


# --- finding 12: malformed manifests are exit 2 with one line ---------------------------------------

MALFORMED = {
    "a list": [],
    "files not a list": {"schema_version": 2, "files": "model.onnx"},
    "a file without sha256": {"schema_version": 2, "files": [{"path": "model.onnx"}]},
    "a path that is a number": {"schema_version": 2, "files": [{"path": 3, "sha256": "0" * 64}]},
    "gate.passed a string": {"schema_version": 2, "files": [], "gate": {"passed": "yes"}},
    "engine a list": {"schema_version": 2, "files": [], "engine": []},
    "no integrity": {"schema_version": 2, "files": []},
    "old schema": {"schema_version": 1, "files": []},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_one_line(tmp_path, case):
    root = tmp_path / "a"
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps(MALFORMED[case]))
    with pytest.raises(ArtifactError):
        verify(root)
    one_error_line(verify_cli(root))
    one_error_line(serve_cli(root))


@pytest.mark.parametrize("content", [b"{", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, b""])
def test_unparseable_manifest_is_one_line(tmp_path, content):
    root = tmp_path / "a"
    root.mkdir()
    (root / "manifest.json").write_bytes(content)
    one_error_line(verify_cli(root), "manifest.json")
    one_error_line(serve_cli(root), "manifest.json")


def test_verify_exit_1_still_means_a_changed_file(tmp_path):
    root = build(tmp_path)
    (root / "notes.txt").write_text("changed")
    proc = verify_cli(root)
    assert proc.returncode == 1 and "changed file notes.txt" in proc.stdout


def test_a_manifest_with_an_integer_of_thousands_of_digits_is_one_line(tmp_path):
    """Python's json refuses an integer over 4300 digits with a ValueError of its own; verify and serve
    read the manifest with the checker's parse, which refuses it in one line."""
    root = build(tmp_path)
    manifest = (root / "manifest.json").read_text()
    (root / "manifest.json").write_text(manifest.replace("{", '{"huge": ' + "7" * 5000 + ",", 1))
    with pytest.raises(ArtifactError, match="integer of 5000 characters"):
        read_manifest(root)
    one_error_line(verify_cli(root), "manifest.json", "integer")
    one_error_line(serve_cli(root), "manifest.json", "integer")
