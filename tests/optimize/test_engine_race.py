"""The engine race: its choice (accuracy first, then speed), its cache, and its refusals."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from engines.artifact import read_manifest, verify
from optimize.compile import auto
from optimize.errors import RecipeError
from optimize.registry import build_config, get
from tests.support.cli import run_optimize


def _entry(name: str, cosine_min: float, p50: float) -> auto.Entry:
    entry = auto.Entry(name, auto.CANDIDATES["ort_fp32"])
    entry.fidelity = {"cosine_min": cosine_min, "cosine_mean": cosine_min}
    entry.latency = {"1": {"p50_ms": p50, "x_baseline": 10 / p50}}
    entry.size_mb = 10.0
    return entry


def _ctx(**gate):
    thresholds = {
        "min_cosine": None,
        "min_mean_cosine": None,
        "max_size_mb": None,
        "min_speedup": None,
        "speedup_batch_size": 1,
        "max_p95_ms": None,
        "latency_batch_size": 1,
        **gate,
    }
    return SimpleNamespace(cfg=OmegaConf.create({"gate": thresholds, "evaluate": {"batch_sizes": [1, 32]}}))


def test_a_candidate_that_fails_accuracy_is_never_shipped_however_fast():
    entries = [_entry("fast_but_wrong", 0.95, 1.0), _entry("slow", 0.999, 9.0), _entry("middle", 0.995, 4.0)]
    winner = auto._choose(entries, _ctx(min_cosine=0.99, min_speedup=1.5))
    assert winner.name == "middle"
    assert entries[0].outcome == "lost: failed accuracy (min_cosine)" and not entries[0].passed
    assert entries[1].outcome == "lost: 2.25x the winner's p50 at batch 1"
    assert [c["name"] for c in winner.accuracy_checks] == ["min_cosine"]  # timed checks are not the race's


def test_when_nothing_passes_the_most_accurate_ships_and_the_gate_will_say_so():
    entries = [_entry("a", 0.97, 1.0), _entry("b", 0.98, 5.0)]
    winner = auto._choose(entries, _ctx(min_cosine=0.99))
    assert winner.name == "b" and not winner.passed
    assert all(e.outcome.startswith("failed accuracy") for e in entries)


def test_size_limits_are_part_of_the_race():
    entries = [_entry("big", 0.999, 1.0), _entry("small", 0.999, 2.0)]
    entries[0].size_mb = 100.0
    assert auto._choose(entries, _ctx(min_cosine=0.99, max_size_mb=50)).name == "small"


def test_race_config_refuses_unknown_candidates_and_stray_params():
    method = get("engine", "auto")
    with pytest.raises(RecipeError, match="unknown"):
        build_config(method, {"candidates": ["ort_fp32", "tensorrt_fp4"]})
    with pytest.raises(RecipeError, match="not candidates"):
        build_config(method, {"candidates": ["ort_fp32"], "candidate_params": {"openvino_int8": {"engine": {}}}})
    cfg = build_config(
        method,
        {
            "candidates": ["openvino_int8"],
            "candidate_params": {"openvino_int8": {"engine": {"smooth_quant_alpha": 0.5}}},
        },
    )
    assert cfg.spec("openvino_int8").engine_params == {"precision": "int8", "smooth_quant_alpha": 0.5}


def _race(tmp_path, name: str, *overrides: str):
    out = tmp_path / name
    proc = run_optimize(
        "engine.params.candidates=[ort_fp32,ort_int8_dynamic_all,openvino_f32,openvino_int8]",
        "evaluate.data.count=16",
        "calibration.count=16",
        "evaluate.batch_sizes=[1]",
        "evaluate.repeats=4",
        "evaluate.warmup=1",
        "evaluate.memory=false",
        "engine.params.timing_repeats=4",
        "gate.min_speedup=null",
        "gate.min_topk_agreement=null",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / (name + '-run')}",
        *overrides,
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    return proc, out


def test_race_end_to_end_ships_a_passing_candidate_and_reuses_its_cache(tmp_path):
    # A gate no INT8 candidate can pass (min cosine 0.9999): an FP32 candidate must ship.
    proc, out = _race(tmp_path, "strict", "gate.min_cosine=0.9999", "gate.min_mean_cosine=0.9999")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    race = read_manifest(out)["stages"]["engine"]
    by_name = {c["name"]: c for c in race["candidates"]}
    assert set(by_name) == {"ort_fp32", "ort_int8_dynamic_all", "openvino_f32", "openvino_int8"}
    assert race["winner"] in ("ort_fp32", "openvino_f32")
    for name in ("ort_int8_dynamic_all", "openvino_int8"):
        assert not by_name[name]["passed_accuracy"] and "failed accuracy" in by_name[name]["outcome"]
        assert by_name[name]["precision"] == "int8" and not by_name[name]["cached"]
    assert by_name["openvino_int8"]["size_mb"] < by_name["openvino_f32"]["size_mb"] / 2
    assert verify(out) == [] and (out / "race" / "front.png").is_file()

    # Another gate on the same model and data: nothing is rebuilt.
    proc, out = _race(tmp_path, "loose", "gate.min_cosine=0.9", "gate.min_mean_cosine=0.9")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    race = read_manifest(out)["stages"]["engine"]
    assert all(c["cached"] for c in race["candidates"])
    assert next(c for c in race["candidates"] if c["name"] == race["winner"])["passed_accuracy"]


def test_causal_lm_race_on_a_tiny_llama_ships_the_fastest_generation_within_the_perplexity_bar(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("openvino_genai")
    from tests.support.models import tiny_llama_folder

    source = tiny_llama_folder(tmp_path / "src")
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={source}",
        "recipe=smollm2_int4_cpu",
        "engine=auto",
        "model.max_length=128",
        "engine.params.candidates=[ort_genai_int4,openvino_genai_int4_g32,openvino_genai_int8]",
        "gate.max_ppl_increase_pct=1000",
        "gate.min_decode_speedup=null",
        "evaluate.data.count=8",
        "evaluate.warmup=1",
        "evaluate.repeats=2",
        "calibration.count=4",
        "evaluate.task_params.perplexity_tokens=256",
        "evaluate.task_params.perplexity_window=128",
        "evaluate.task_params.prompt_tokens=16",
        "evaluate.task_params.new_tokens=8",
        "evaluate.task_params.lm_eval_tasks=[]",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = read_manifest(out)
    race = manifest["stages"]["engine"]
    by_name = {c["name"]: c for c in race["candidates"]}
    assert set(by_name) == {"ort_genai_int4", "openvino_genai_int4_g32", "openvino_genai_int8"}
    for candidate in by_name.values():
        metrics = candidate["metrics"]
        assert metrics["perplexity"] > 0 and metrics["generation"]["decode_tok_s"]["p50"] > 0
        assert metrics["generation_ms"] == pytest.approx(auto_generation_ms(metrics))
    winner = by_name[race["winner"]]
    assert winner["outcome"].startswith("won")
    assert winner["metrics"]["generation_ms"] == min(
        c["metrics"]["generation_ms"] for c in by_name.values() if c["passed_accuracy"]
    )
    assert manifest["engine"]["format"] == {"ort_genai_int4": "onnxruntime-genai"}.get(race["winner"], "openvino-genai")
    assert "engine race" in proc.stdout and "generation ms" in proc.stdout


def auto_generation_ms(metrics: dict) -> float:
    from optimize.compile.race_lm import generation_ms

    return generation_ms(metrics["generation"], metrics["generation"]["new_tokens"])


def test_an_openvino_engine_this_machine_cannot_run_is_refused_before_any_weights_load(monkeypatch):
    import importlib.util

    from engines import openvino_runner

    method = get("engine", "openvino")
    monkeypatch.setattr(openvino_runner, "missing_cpu_features", lambda precision: ["avx512_bf16 or amx_bf16"])
    with pytest.raises(RecipeError, match=r"precision=bf16: this CPU has no native bf16 \(it lacks avx512_bf16"):
        build_config(method, {"precision": "bf16"})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "nncf" else real_find_spec(name))
    with pytest.raises(RecipeError, match="precision=int8: needs nncf: pip install nncf"):
        build_config(method, {"precision": "int8"})
