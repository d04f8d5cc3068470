"""`python -m optimize.train.tiny_lm`: a full-precision Llama trained offline on the calibration split
of CPython's prose learns (held-out perplexity far below a random model's), loads as a model source,
and bad arguments are one line, exit 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from optimize.train import tiny_lm as train_tiny_lm


def _held_out_perplexity(folder, tokens: int = 1024) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calibration import cpython_docs

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer(" ".join(cpython_docs("evaluation")))["input_ids"][:tokens]
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        losses = [
            model(input_ids=torch.tensor([ids[i : i + 256]]), labels=torch.tensor([ids[i : i + 256]])).loss
            for i in range(0, len(ids), 256)
        ]
    return float(np.exp(np.mean([float(x) for x in losses])))


@pytest.mark.slow
def test_the_trained_model_learns_the_prose_and_never_sees_the_evaluation_text(tmp_path):
    out = tmp_path / "lm"
    record = train_tiny_lm.train(out, hidden=128, layers=2, steps=150, vocab_size=512, batch_size=8, lr=6e-3)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "train.json").read_text()) == record
    assert record["text"] == "python_prose, calibration split" and record["parameters"] > 0
    config = json.loads((out / "config.json").read_text())
    # A random model's held-out perplexity is about its vocabulary; this one has learned the prose.
    assert _held_out_perplexity(out) < 0.4 * config["vocab_size"]
    from calibration import cpython_docs

    held_out = set(cpython_docs("evaluation"))
    assert not held_out & set(train_tiny_lm.training_text())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hidden", "100"], "multiple of 64"),
        (["--hidden", "10" + "0" * 30], "multiple of 64"),
        (["--steps", "0"], "at least 1"),
        (["--lr", "0"], "--lr"),
        (["--from", "x.gguf", "--lr", "nan"], "--lr"),
        (["--from", "/nonexistent/model"], "no such file or directory"),
        (["--rotate"], "--rotate rotates a model given with --from"),
        (["--seed", "1" + "0" * 30], "--seed must be at least 0"),
        (["--from", "x.gguf", "--rotate", "--steps", "0", "--seed", "-1"], "--seed must be at least 0"),
        (["--rotate", "--steps", "0"], "--rotate rotates a model given with --from"),
    ],
)
def test_bad_arguments_are_one_line_and_nothing_is_written(tmp_path, args, message):
    out = tmp_path / "lm"
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train.tiny_lm", str(out), *args], capture_output=True, text=True
    )
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no model, and no partial folder beside it


def test_a_folder_that_holds_files_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train.tiny_lm", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_a_file_or_an_unwritable_place_for_the_model_is_refused(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"\xff\xfe not a folder")
    for out, message in ((target, "is a file"), (tmp_path / "missing" / "lm", "is not a folder")):
        proc = subprocess.run(
            [sys.executable, "-m", "optimize.train.tiny_lm", str(out)], capture_output=True, text=True
        )
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert target.read_bytes() == b"\xff\xfe not a folder" and not (tmp_path / "missing").exists()


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
def test_the_command_line_trains_into_the_folder_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "lm"
    out.mkdir()  # an empty folder is taken
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train.tiny_lm", str(out), "--hidden", "64", "--layers", "1", "--steps", "2"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 2
    assert (out / "model.safetensors").is_file() and [p.name for p in tmp_path.iterdir()] == ["lm"]


@pytest.mark.slow
def test_training_further_from_a_model_keeps_its_tokenizer_and_moves_its_weights_in_full_precision(tmp_path):
    import torch
    from safetensors.torch import load_file

    start, out = tmp_path / "start", tmp_path / "further"
    train_tiny_lm.train(start, hidden=64, layers=1, steps=5, vocab_size=300, batch_size=4)
    record = train_tiny_lm.continue_training(out, str(start), steps=3, seq_len=32, batch_size=2, lr=1e-2)
    assert record["steps"] == 3 and record["from"]["source"] == str(start)
    assert list(record["from"]["sha256"]) == ["model.safetensors"]
    assert (out / "tokenizer.json").read_text() == (start / "tokenizer.json").read_text()
    before, after = load_file(start / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(t.dtype == torch.float32 for t in after.values())
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert "model.layers.0.mlp.down_proj.weight" in moved


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
def test_a_rotated_copy_is_the_same_function_with_no_weight_where_it_was(tmp_path):
    """--from SOURCE --rotate --steps 0: saved untied, its logits the source's, every matrix new, the
    rotation recorded; a model it cannot rotate exactly (Gemma 3) is one line, exit 2, nothing written."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_archs import tiny_folder

    source, out = tiny_folder("llama", tmp_path / "src"), tmp_path / "rotated"
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.train.tiny_lm", str(out), "--from", str(source), "--rotate", "--steps", "0"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "train.json").read_text())
    assert record["steps"] == 0 and record["rotated"]["seed"] == 0
    assert record["rotated"]["max_logit_difference_over_spread"] <= 1e-3
    ids = torch.arange(3, 60).unsqueeze(0)
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(str(f)).eval()(input_ids=ids).logits for f in (source, out)]
    assert float((logits[1] - logits[0]).abs().max()) <= 1e-3 * float(logits[0].std())
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert "lm_head.weight" in after and json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    name = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.allclose(before[name], after[name], atol=1e-3)

    gemma, refused = tiny_folder("gemma3", tmp_path / "gemma"), tmp_path / "no"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "optimize.train.tiny_lm",
            str(refused),
            "--from",
            str(gemma),
            "--rotate",
            "--steps",
            "0",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--rotate: a residual rotation is kept exact for llama" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not refused.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma", "rotated", "src"]
