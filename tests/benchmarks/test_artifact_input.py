"""What the benchmarks read from the artifact they are given (benchmarks/artifact_input.py): a whole,
unedited artifact of the kind they time, and its tokenizer; anything else is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import artifact_input
from tests.support.tiny_llm import GENAI_ENGINE, write_manifest


def tokenizer_file(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


@pytest.fixture
def artifact(tmp_path) -> Path:
    """An artifact whose manifest lists its one file, a word-level tokenizer, under a GenAI engine."""
    folder = tmp_path / "artifact"
    tokenizer_file(folder / "genai" / "tokenizer.json")
    write_manifest(folder)
    return folder


def refused(capsys, call, *args, **kwargs) -> str:
    with pytest.raises(SystemExit) as exit_info:
        call(*args, **kwargs)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    return error


def test_a_whole_artifact_gives_its_manifest_and_its_tokenizer(artifact):
    manifest = artifact_input.artifact_manifest(artifact, serves="causal_lm")
    assert manifest["engine"] == GENAI_ENGINE
    encode, decode = artifact_input.artifact_tokenizer(artifact)
    assert encode("hello world again") == [1, 2, 0]
    assert decode([2, 1]) == "world hello"


def test_an_artifact_of_another_kind_is_refused(artifact, capsys):
    assert refused(capsys, artifact_input.artifact_manifest, artifact, serves="encoder") == (
        f"error: {artifact}: its engine (onnxruntime-genai) does not serve encoder, which this benchmark times\n"
    )


def test_a_changed_missing_or_extra_file_is_refused(artifact, capsys):
    tokenizer = artifact / "genai" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace("hello", "howdy"))
    assert refused(capsys, artifact_input.artifact_manifest, artifact).startswith(
        f"error: {artifact} does not match its manifest: "
    )
    write_manifest(artifact)  # sealed again: whole once more
    artifact_input.artifact_manifest(artifact)
    (artifact / "stray.txt").write_text("not listed")
    assert refused(capsys, artifact_input.artifact_manifest, artifact) == (
        f"error: {artifact} does not match its manifest: unexpected file stray.txt (not in the manifest)\n"
    )
    (artifact / "stray.txt").unlink()
    tokenizer.unlink()
    assert refused(capsys, artifact_input.artifact_manifest, artifact) == (
        f"error: {artifact} does not match its manifest: missing file genai/tokenizer.json\n"
    )


def test_an_edited_or_broken_manifest_is_refused(artifact, capsys):
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["engine"]["format"] = "openvino-genai"  # edited without sealing
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    assert "was modified after it was written" in refused(capsys, artifact_input.artifact_manifest, artifact)
    (artifact / "manifest.json").write_text("[]")
    assert "malformed manifest" in refused(capsys, artifact_input.artifact_manifest, artifact)
    assert refused(capsys, artifact_input.artifact_manifest, artifact / "genai" / "tokenizer.json").endswith(
        "is not a directory\n"
    )


def test_a_missing_or_unreadable_tokenizer_is_refused(tmp_path, capsys):
    assert refused(capsys, artifact_input.artifact_tokenizer, tmp_path) == f"error: {tmp_path} has no tokenizer.json\n"
    (tmp_path / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    assert refused(capsys, artifact_input.artifact_tokenizer, tmp_path).startswith(
        f"error: {tmp_path / 'tokenizer.json'}: not a tokenizer the tokenizers library reads"
    )


def test_a_report_path_that_cannot_be_written_is_refused_before_anything_runs(artifact, tmp_path, capsys):
    artifact_input.refuse_unwritable(None, "-", tmp_path / "report.json")  # not asked, stdout, a new file
    assert refused(capsys, artifact_input.refuse_unwritable, None, tmp_path) == (
        f"error: {tmp_path} is a folder; give the file the report should be written to\n"
    )
    missing = tmp_path / "no-such-folder" / "report.json"
    assert refused(capsys, artifact_input.refuse_unwritable, missing) == (
        f"error: {missing}: there is no folder {missing.parent} to write it in\n"
    )
    from benchmarks import llamacpp_perplexity

    # the benchmark stops on it before reading the artifact (whose recipe here names no GGUF)
    assert refused(capsys, llamacpp_perplexity.main, [str(artifact), "--json", str(missing)]) == (
        f"error: {missing}: there is no folder {missing.parent} to write it in\n"
    )
