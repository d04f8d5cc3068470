import json

import pytest

from engines.artifact import ArtifactError, read_manifest, sha256_file, verify
from optimize import artifact
from optimize.errors import RecipeError


def make_stage(tmp_path):
    final = tmp_path / "out" / "artifact"
    return final


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    final = make_stage(tmp_path)
    with artifact.staging(final) as stage:
        (stage / "model.bin").write_bytes(b"weights")
        (stage / "tokenizer").mkdir()
        (stage / "tokenizer" / "tokenizer.json").write_text("{}")
        manifest = artifact.write_manifest(stage, {"id": "x"})
        artifact.publish(stage, final)
    assert [f["path"] for f in manifest["files"]] == ["model.bin", "tokenizer/tokenizer.json"]
    assert manifest["files"][0]["sha256"] == sha256_file(final / "model.bin")
    assert read_manifest(final)["schema_version"] == artifact.SCHEMA_VERSION
    assert verify(final) == []


def test_verify_reports_changed_missing_and_unexpected_files(tmp_path):
    final = make_stage(tmp_path)
    with artifact.staging(final) as stage:
        (stage / "a.bin").write_bytes(b"a")
        (stage / "b.bin").write_bytes(b"b")
        artifact.write_manifest(stage, {})
        artifact.publish(stage, final)
    (final / "a.bin").write_bytes(b"tampered")
    (final / "b.bin").unlink()
    (final / "c.bin").write_bytes(b"c")
    assert verify(final) == [
        "changed file a.bin (sha256 differs from the manifest)",
        "missing file b.bin",
        "unexpected file c.bin (not in the manifest)",
    ]


def test_an_error_inside_staging_leaves_nothing_behind(tmp_path):
    final = make_stage(tmp_path)
    with pytest.raises(RuntimeError):
        with artifact.staging(final) as stage:
            (stage / "model.onnx").write_bytes(b"half")
            raise RuntimeError("killed")
    assert not final.exists()
    assert list(final.parent.iterdir()) == []


def test_destination_must_be_empty_unless_overwrite(tmp_path):
    final = tmp_path / "taken"
    final.mkdir()
    (final / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="already exists"):
        artifact.check_destination(final, overwrite=False)
    with pytest.raises(RecipeError, match="not an artifact"):
        artifact.check_destination(final, overwrite=True)
    artifact.check_destination(tmp_path / "fresh", overwrite=False)


def test_publish_replaces_an_old_artifact_only_at_the_end(tmp_path):
    final = make_stage(tmp_path)
    for content in (b"old", b"new"):
        with artifact.staging(final) as stage:
            (stage / "model.onnx").write_bytes(content)
            artifact.write_manifest(stage, {})
            artifact.publish(stage, final)
    assert (final / "model.onnx").read_bytes() == b"new"
    assert sorted(p.name for p in final.parent.iterdir()) == ["artifact"]


def test_read_manifest_rejects_non_artifacts(tmp_path):
    with pytest.raises(ArtifactError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(ArtifactError, match="schema_version 99"):
        read_manifest(tmp_path)
