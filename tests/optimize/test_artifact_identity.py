"""The manifest's id is a content hash of what went in and what was built; parent_id names what the
artifact came from (the artifact its source lies in, else the source's own bytes)."""

from __future__ import annotations

import hashlib
import json
import shutil

from engines.artifact import read_manifest
from optimize import artifact
from optimize.reports.ci import JUNIT_XML, REPORT_MD
from optimize.runlog import LOG_FILE


def test_the_id_is_recomputed_from_the_recipe_the_source_and_the_engine_files(minilm_artifact, tmp_path):
    manifest = read_manifest(minilm_artifact)
    built = tmp_path / "built"  # the artifact as it was when the id was taken: before manifest, reports, log
    ignored = shutil.ignore_patterns("manifest.json", REPORT_MD, JUNIT_XML, LOG_FILE)
    shutil.copytree(minilm_artifact, built, ignore=ignored)
    recipe, source = manifest["recipe"]["resolved"], manifest["model"]["sha256"]
    assert artifact.content_id(recipe, source, built) == manifest["id"]
    # Where the outputs go is not identity; what the engine is, is.
    moved = dict(recipe, output_dir="/elsewhere", overwrite=True, report={"junit": "x.xml"})
    assert artifact.content_id(moved, source, built) == manifest["id"]
    assert artifact.content_id(dict(recipe, seed=recipe["seed"] + 1), source, built) != manifest["id"]
    (built / "tokenizer" / "tokenizer_config.json").write_text("{}")
    assert artifact.content_id(recipe, source, built) != manifest["id"]


def test_parent_is_the_source_weights_or_the_artifact_the_source_came_from(minilm_artifact):
    manifest = read_manifest(minilm_artifact)
    weights = manifest["model"]["sha256"]
    assert weights  # the MiniLM safetensors
    assert manifest["parent_id"] == hashlib.sha256(json.dumps(weights, sort_keys=True).encode()).hexdigest()
    # A model taken from an artifact (its ONNX file as model.source) names that artifact as its parent.
    engine_file = str(minilm_artifact / manifest["engine"]["file"])
    assert artifact.parent_id(engine_file, {"model.onnx": "..."}) == manifest["id"]
    assert artifact.parent_id("/nonexistent/model", {}) is None
