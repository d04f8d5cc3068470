"""The distillation loop on tiny random models: the loss goes down, an interrupted run resumes from
its checkpoint, the loss curve ships, and a student larger than the teacher is a recipe error."""

from __future__ import annotations

import pytest

from optimize import tasks
from optimize.distill import data, objectives, training
from optimize.distill.logit_hidden_kd import logit_hidden_kd
from optimize.distill.student import make_student
from optimize.errors import RecipeError
from optimize.registry import build_config, get
from tests.support.cli import run_optimize
from tests.support.context import torch_context
from tests.support.models import tiny_bert, tiny_llama, torch_model


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))


def run_distill(teacher, tmp_path, **params):
    ctx = torch_context(teacher, tmp_path)
    cfg = build_config(
        get("distill", "logit_hidden_kd"),
        dict({"batch_size": 8, "seq_len": 16, "lr": 3e-3, "max_seconds": None}, **params),
    )
    out = logit_hidden_kd(torch_model(teacher), cfg, ctx)
    return out, out.record, ctx


def test_loss_goes_down_and_the_curve_ships(tmp_path):
    teacher = tiny_bert()
    out, record, _ = run_distill(teacher, tmp_path, student_layers=2, max_steps=30)
    losses = record["loss_curve_summary"]
    assert losses["last5_mean"] < losses["first5_mean"] * 0.85
    assert len(out.module.encoder.layer) == 2 and len(teacher.encoder.layer) == 4
    assert record["layer_map"] == [0, 3]  # evenly spaced: the first and the last layer kept
    assert out.files["distill/loss_curve.png"].read_bytes()[:4] == b"\x89PNG"


def test_an_interrupted_run_resumes_from_its_checkpoint(tmp_path):
    import torch

    _, first, _ = run_distill(tiny_bert(), tmp_path, student_layers=2, max_steps=4, checkpoint_every=2)
    assert first["steps"] == 4 and first["resumed_from_step"] == 0
    resumed, second, _ = run_distill(tiny_bert(), tmp_path, student_layers=2, max_steps=6, checkpoint_every=2)
    assert second["resumed_from_step"] == 4 and second["steps"] == 6
    torch.manual_seed(0)
    straight, third, _ = run_distill(
        tiny_bert(), tmp_path, student_layers=2, max_steps=6, checkpoint_every=2, resume=False, seed=0
    )
    assert third["resumed_from_step"] == 0
    # same data order and optimizer state: resuming gives the weights an uninterrupted run gives
    for a, b in zip(resumed.module.parameters(), straight.module.parameters()):
        assert torch.allclose(a, b, atol=1e-5)


def test_max_seconds_bounds_the_run(tmp_path):
    _, record, _ = run_distill(tiny_bert(), tmp_path, student_layers=2, max_steps=10_000, max_seconds=0.5)
    assert record["stopped_by"] == "max_seconds" and record["steps"] < 10_000


@pytest.mark.slow
def test_causal_lm_logit_kd_goes_down(tmp_path):
    import torch

    teacher = tiny_llama()
    student, layer_map = make_student(
        teacher,
        teacher,
        build_config(get("distill", "logit_hidden_kd"), {"student_layers": 2}),
        torch_context(teacher, tmp_path),
    )
    cfg = build_config(get("distill", "logit_hidden_kd"), {"max_steps": 25, "lr": 3e-3, "max_seconds": None})
    objective = objectives.LogitObjective(teacher, student, layer_map, cfg)
    ids = torch.randint(0, 100, (32, 16), generator=torch.Generator().manual_seed(0))
    run = training.train(student, objective, data.Batches({"input_ids": ids}, 8, 0), cfg, tmp_path / "ckpt")
    assert sum(run["losses"][-5:]) < sum(run["losses"][:5]) * 0.85
    assert (tmp_path / "ckpt" / "student.safetensors").is_file()  # tied LM head saved without pickle


def test_a_student_larger_than_the_teacher_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="larger than the teacher"):
        run_distill(tiny_bert(), tmp_path, student_layers=5, max_steps=1)


def test_distill_without_a_student_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="needs a student"):
        run_distill(tiny_bert(), tmp_path, max_steps=1)


@pytest.mark.slow
def test_cli_bad_targets_exit_2_with_one_clear_line(tmp_path):
    common = [
        "recipe=minilm_prune_distill_int8",
        "calibration.count=16",
        "evaluate.data.count=16",
        "evaluate.latency=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    heads = run_optimize(*common, "prune.params.heads=13", f"output_dir={tmp_path / 'a'}")
    assert heads.returncode == 2 and "only 12 attention heads" in heads.stderr + heads.stdout
    student = run_optimize(*common, "prune=none", "distill.params.student_layers=7", f"output_dir={tmp_path / 'b'}")
    assert student.returncode == 2 and "larger than the teacher" in student.stderr + student.stdout
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_recovery_row_and_gate_for_original_pruned_and_distilled_perplexity():
    from optimize import gate

    metrics = {
        "baseline": {"perplexity": 10.0},
        "candidate": {"perplexity": 14.0},
        "table": [["perplexity", "", "", ""]],
    }
    objectives.add_recovery(metrics, pruned=20.0)  # lost 10, won back 6
    assert metrics["candidate"]["distill_recovery"] == pytest.approx(0.6)
    assert metrics["table"][1][1:3] == ["10.000", "20.000 / 14.000"]
    verdict = gate.judge(metrics["baseline"], metrics["candidate"], {"min_distill_recovery": 0.5})
    assert verdict.passed and verdict.checks[0].value == pytest.approx(0.6)


def test_cached_teacher_outputs_match_a_fresh_teacher_pass_on_any_batch(tmp_path):
    """The encoder objective caches the teacher once; a step's rows must read what the teacher
    computes for exactly those samples, whatever batch they were cached in."""
    import torch

    teacher = tiny_bert()
    ctx = torch_context(teacher, tmp_path)
    cfg = build_config(get("distill", "logit_hidden_kd"), {"batch_size": 4, "seq_len": 16, "student_layers": 2})
    student, layer_map = make_student(teacher, teacher, cfg, ctx)
    objective = objectives.Objective.for_task(tasks.get("sentence_embedding"), teacher, student, layer_map, cfg, ctx)
    batches = data.Batches.for_task(tasks.get("sentence_embedding"), ctx, cfg)
    objective.prepare(batches)
    batch = batches.batch(step=3)
    rows = batch.pop("rows")
    with torch.no_grad():
        fresh = teacher(**batch, output_hidden_states=True)
    last = layer_map[-1] + 1
    assert torch.allclose(
        objective.cached["hidden"][last][rows].float(), fresh.hidden_states[last], atol=1e-2, rtol=1e-3
    )
    pooled = objectives._pool(fresh.last_hidden_state, batch["attention_mask"], objective.pooling)
    assert torch.allclose(objective.cached["embedding"][rows], pooled, atol=1e-5)


def test_the_learning_rate_warms_up_then_decays_to_zero_by_steps_or_seconds():
    cfg = build_config(
        get("distill", "logit_hidden_kd"),
        {"lr": 1e-3, "lr_schedule": "cosine", "warmup": 0.1, "max_steps": 100, "max_seconds": 50},
    )
    rates = [training.learning_rate(cfg, training.progress(cfg, step, 0.0)) for step in range(100)]
    assert rates[0] < 2e-5 and max(rates) == pytest.approx(1e-3, rel=0.02)
    assert rates.index(max(rates)) in (9, 10) and rates[-1] < 1e-5
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))  # monotone after warm-up
    # wall time nearer its bound than steps: the schedule follows the seconds
    assert training.progress(cfg, 10, 40.0) == pytest.approx(0.8)
    linear = build_config(get("distill", "logit_hidden_kd"), {"lr": 1e-3, "lr_schedule": "linear", "max_seconds": None})
    assert training.learning_rate(linear, 0.5) == pytest.approx(5e-4)
    constant = build_config(get("distill", "logit_hidden_kd"), {"lr": 1e-3})
    assert training.learning_rate(constant, 0.99) == 1e-3


@pytest.mark.parametrize(
    "params, message", [({"lr_schedule": "step"}, "lr_schedule=step"), ({"warmup": 1.0}, "warmup=1.0")]
)
def test_bad_schedules_are_recipe_errors(params, message):
    with pytest.raises(RecipeError, match=message):
        build_config(get("distill", "logit_hidden_kd"), params)


def test_matching_only_the_last_layer_caches_and_compares_only_it(tmp_path):
    teacher = tiny_bert()
    ctx = torch_context(teacher, tmp_path)
    cfg = build_config(get("distill", "logit_hidden_kd"), {"student_layers": 2, "hidden_layers": "last"})
    student, layer_map = make_student(teacher, teacher, cfg, ctx)
    objective = objectives.EmbeddingObjective(teacher, student, layer_map, cfg, ctx)
    assert objective.matched_layers() == [(1, 3)]
    objective.prepare(data.Batches.for_task(tasks.get("sentence_embedding"), ctx, cfg))
    assert list(objective.cached["hidden"]) == [4]  # hidden_states[4]: the teacher's last layer output
    every = objectives.Objective(
        teacher, student, layer_map, build_config(get("distill", "logit_hidden_kd"), {"student_layers": 2})
    )
    assert every.matched_layers() == [(0, 0), (1, 3)]
