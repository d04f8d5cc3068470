"""The engine race: its choice (accuracy first, then speed), its cache, and its refusals."""

import shutil

import pytest
from omegaconf import OmegaConf

from engines.artifact import read_manifest, verify
from optimize import workload
from optimize.compile.race import choice
from optimize.compile.race import lm as race_lm
from optimize.compile.race.candidates import CANDIDATES
from optimize.compile.race.choice import untimed_thresholds
from optimize.compile.race.entry import Entry
from optimize.config import recipe_dict
from optimize.errors import RecipeError
from optimize.registry import build_config, get
from tests.support.cli import TINY_LM_RACE, run_optimize


def _entry(name: str, cosine_min: float, p50: float) -> Entry:
    entry = Entry(name, CANDIDATES["ort_fp32"])
    entry.fidelity = {"cosine_min": cosine_min, "cosine_mean": cosine_min}
    entry.latency = {"1": {"p50_ms": p50, "x_baseline": 10 / p50}}
    entry.size_mb = 10.0
    return entry


def _recipe(batches=None, **gate):
    thresholds = {
        "min_cosine": None,
        "min_mean_cosine": None,
        "max_size_mb": None,
        "min_speedup": None,
        "speedup_batch_size": 1,
        "max_p95_ms": None,
        "latency_batch_size": 1,
        "request_shape": None,
        **gate,
    }
    cfg = {"gate": thresholds, "evaluate": {"batch_sizes": [1, 32]}, "workload": {"batches": batches}}
    return OmegaConf.create(cfg)


def _thresholds(cfg) -> dict:
    return untimed_thresholds(recipe_dict(cfg.gate))


def _choose(entries, recipe, baseline=None):
    """The race's choice with the workload the recipe resolves to (one point unless it declares more)."""
    base = baseline or {"1": 10.0, "32": 300.0}
    return choice.choose(entries, workload.resolve(recipe), base, _thresholds(recipe))


def test_a_candidate_that_fails_accuracy_is_never_shipped_however_fast():
    entries = [_entry("fast_but_wrong", 0.95, 1.0), _entry("slow", 0.999, 9.0), _entry("middle", 0.995, 4.0)]
    winner = _choose(entries, _recipe(min_cosine=0.99, min_speedup=1.5))
    assert winner.name == "middle"
    assert entries[0].outcome == "lost: failed accuracy (min_cosine)" and not entries[0].passed
    assert entries[1].outcome == "lost: 2.25x the winner's p50 at batch 1"
    assert [c["name"] for c in winner.accuracy_checks] == ["min_cosine"]  # timed checks are not the race's


def test_when_nothing_passes_the_most_accurate_ships_and_the_gate_will_say_so():
    entries = [_entry("a", 0.97, 1.0), _entry("b", 0.98, 5.0)]
    winner = _choose(entries, _recipe(min_cosine=0.99))
    assert winner.name == "b" and not winner.passed
    assert all(e.outcome.startswith("failed accuracy") for e in entries)


def test_size_limits_are_part_of_the_race():
    entries = [_entry("big", 0.999, 1.0), _entry("small", 0.999, 2.0)]
    entries[0].size_mb = 100.0
    assert _choose(entries, _recipe(min_cosine=0.99, max_size_mb=50)).name == "small"


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
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")},
    )
    return proc, out


def test_race_end_to_end_ships_a_passing_candidate_and_reuses_its_cache(minilm_default_race, tmp_path):
    # The cache of the default recipe's race (the session's, tests/conftest.py), which built every
    # default candidate afresh from the same model and calibration set, with the key that signed it.
    shutil.copytree(minilm_default_race.cache, tmp_path / "cache")
    shutil.copytree(minilm_default_race.config, tmp_path / "config")
    # Another gate, one no INT8 candidate can pass (min cosine 0.9999): nothing is rebuilt, and an FP32
    # candidate must ship.
    proc, out = _race(tmp_path, "strict", "gate.min_cosine=0.9999", "gate.min_mean_cosine=0.9999")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    race = read_manifest(out)["stages"]["engine"]
    assert all(c["cached"] for c in race["candidates"])
    by_name = {c["name"]: c for c in race["candidates"]}
    assert set(by_name) == {"ort_fp32", "ort_int8_dynamic_all", "openvino_f32", "openvino_int8"}
    assert race["winner"] in ("ort_fp32", "openvino_f32")
    for name in ("ort_int8_dynamic_all", "openvino_int8"):
        assert not by_name[name]["passed_accuracy"] and "failed accuracy" in by_name[name]["outcome"]
        assert by_name[name]["precision"] == "int8"
    assert by_name["openvino_int8"]["size_mb"] < by_name["openvino_f32"]["size_mb"] / 2
    assert verify(out) == [] and (out / "race" / "front.png").is_file()


@pytest.mark.slow
def test_causal_lm_race_on_a_tiny_llama_ships_the_fastest_generation_within_the_perplexity_bar(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("openvino_genai")
    from tests.support.models import tiny_llama_folder

    source = tiny_llama_folder(tmp_path / "src")
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={source}",
        *(o for o in TINY_LM_RACE if not o.startswith("workload.requests=")),
        "engine=auto",
        "engine.params.candidates=[ort_genai_int4,openvino_genai_int4_g32,openvino_genai_int8]",
        "workload.requests=[{prompt:16,output:8},{prompt:40,output:8}]",
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
        assert candidate["metrics"]["perplexity"] > 0
    winner = by_name[race["winner"]]
    assert winner["outcome"].startswith("won")
    passing = [c for c in by_name.values() if c["passed_accuracy"]]
    survivors = [c for c in passing if not c["served_cut"]]
    never_slower = [c for c in survivors if not c["slower_than_baseline_at"]] or survivors
    assert winner in never_slower and winner["cost"] <= min(c["cost"] for c in never_slower) * 1.05
    for candidate in passing:  # timed as served, on a real server on loopback, at every shape and level
        metrics = candidate["metrics"]
        served = metrics["served"]
        assert {shape: set(levels) for shape, levels in served.items()} == {"16x8": {"1", "16"}, "40x8": {"1", "16"}}
        assert all(cell["tokens_per_s"] > 0 and not cell["failed"] for lv in served.values() for cell in lv.values())
        assert candidate["cost"] >= 1.0  # the served cost: 1 is the best at every level
        # One request at a time is read from the one-client cells, not timed again in process.
        assert set(metrics["requests"]) == {"16x8", "40x8"}
        one = served["16x8"]["1"]
        if one["itl_p50_ms"]:  # a random tiny model's tokens may detokenize to no text: no gaps to read
            assert metrics["generation"]["decode_tok_s"]["p50"] == pytest.approx(1e3 / one["itl_p50_ms"])
        assert metrics["generation"]["decode_tok_s"]["p50"] > 0
        assert metrics["generation_ms"] == one["request_ms"] and metrics["generation"]["as_served_clients"] == 1
    assert race["baseline"]["requests"]["40x8"]["request_ms"] > 0  # the baseline, in process
    # The evaluation after the race reads the baseline's perplexity and timings the race measured in
    # this run (the same ids, shapes and machine) instead of measuring them again.
    evaluated = manifest["metrics"]["baseline"]
    assert evaluated["perplexity"] == race["baseline"]["perplexity"] and evaluated["perplexity_from"]
    assert evaluated["requests"] == race["baseline"]["requests"] and evaluated["timed_in"].startswith(
        "the engine race, earlier in this run"
    )
    # Its sample too: generated by the race while its weight pages were read in, not read back for it.
    assert evaluated["sample"]["prompt"] and evaluated["sample_from"] == "the engine race, earlier in this run"
    halving = race["served_halving"]
    assert halving["rounds"][0] == [c["name"] for c in passing]
    assert set(halving["cut"]) == {c["name"] for c in passing if c["served_cut"]}
    assert "TTFT ms 40x8" in proc.stdout and "request ms 40x8" in proc.stdout
    assert "served 16 clients tok/s (TTFT p95 ms)" in proc.stdout
    assert manifest["engine"]["format"] == {"ort_genai_int4": "onnxruntime-genai"}.get(race["winner"], "openvino-genai")
    assert "engine race" in proc.stdout and "generation ms" in proc.stdout


def test_an_openvino_engine_this_machine_cannot_run_is_refused_before_any_weights_load(monkeypatch):
    import importlib.util

    from engines.openvino import runner as openvino_runner

    method = get("engine", "openvino")
    monkeypatch.setattr(openvino_runner, "missing_cpu_features", lambda precision: ["avx512_bf16 or amx_bf16"])
    with pytest.raises(RecipeError, match=r"precision=bf16: this CPU has no native bf16 \(it lacks avx512_bf16"):
        build_config(method, {"precision": "bf16"})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "nncf" else real_find_spec(name))
    with pytest.raises(RecipeError, match="precision=int8: needs nncf: pip install nncf"):
        build_config(method, {"precision": "int8"})


def _at(name: str, b1: float, b32: float, cosine_min: float = 0.999) -> Entry:
    entry = _entry(name, cosine_min, b1)
    entry.latency["32"] = {"p50_ms": b32, "x_baseline": 300 / b32}
    return entry


BASE_P50 = {"1": 10.0, "32": 300.0}


def test_a_workload_of_one_point_races_exactly_as_before():
    """Declaring the one point the race used is today's race: same winner, same outcome lines."""

    def race(batches):
        entries = [_at("a", 4.0, 400.0), _at("b", 3.0, 500.0), _at("c", 2.0, 100.0, cosine_min=0.9)]
        winner = _choose(entries, _recipe(batches, min_cosine=0.99, min_speedup=1.5), BASE_P50)
        return winner.name, [e.outcome for e in entries]

    assert (
        race(None)
        == race([1])
        == (
            "b",
            [
                "lost: 1.33x the winner's p50 at batch 1",
                "won: fastest at batch 1 of the 2 that pass accuracy",
                "lost: failed accuracy (min_cosine)",
            ],
        )
    )


def test_fastest_at_one_point_and_slower_than_the_baseline_at_another_does_not_ship():
    entries = [_at("spiky", 2.0, 320.0), _at("balanced", 4.0, 250.0), _at("wrong", 1.0, 50.0, cosine_min=0.9)]
    winner = _choose(entries, _recipe([1, 32], min_cosine=0.99), BASE_P50)
    assert winner.name == "balanced" and winner.cost == pytest.approx(127.0)
    assert entries[0].slower_than_baseline_at == ["batch 32"]
    assert entries[0].outcome == "lost: slower than the baseline at batch 32"
    assert (
        winner.outcome == "won: fastest over the workload (batch 1: 0.50, batch 32: 0.50) of the 2 that pass accuracy"
    )
    # When every passing candidate is slower somewhere, the cheapest still ships, and says so.
    alone = [_at("spiky", 2.0, 320.0), _at("wrong", 1.0, 50.0, cosine_min=0.9)]
    winner = _choose(alone, _recipe([1, 32], min_cosine=0.99), BASE_P50)
    assert winner.name == "spiky" and "slower than the baseline at batch 32, as every passing one" in winner.outcome


def test_weights_decide_between_a_batch_1_and_a_batch_32_candidate():
    def winner(batches):
        entries = [_at("quick_single", 2.0, 200.0), _at("quick_batch", 5.0, 120.0)]
        return _choose(entries, _recipe(batches, min_cosine=0.99), BASE_P50).name

    assert winner({1: 0.999, 32: 0.001}) == "quick_single"
    assert winner({1: 0.7, 32: 0.3}) == "quick_batch"  # 0.7*5 + 0.3*120 = 39.5 against 61.4


def test_within_noise_the_balanced_candidate_wins_and_the_lopsided_one_is_named():
    # Costs 101.0 and 100.5 (within 5%): "lopsided" is cheapest but 2x the best at batch 1.
    entries = [_at("even", 2.0, 200.0), _at("lopsided", 4.0, 197.0)]
    winner = _choose(entries, _recipe([1, 32], min_cosine=0.99), BASE_P50)
    assert winner.name == "even"
    assert entries[1].outcome == (
        "lost: 1.00x the winner's weighted p50; within 5% of the winner's cost (within noise) but "
        "2.00x the winner's time at batch 1"
    )
    # Out of noise, cost decides and nothing is named.
    entries = [_at("even", 2.0, 200.0), _at("lopsided", 4.0, 150.0)]
    assert _choose(entries, _recipe([1, 32], min_cosine=0.99), BASE_P50).name == "lopsided"
    assert "within noise" not in entries[0].outcome


def _lm(name: str, short_ms: float, long_ms: float, ppl_pct: float = 10.0) -> Entry:
    entry = Entry(name, CANDIDATES["ort_genai_int4"])
    generation = {"ttft_ms": {"p50": 50.0}, "decode_tok_s": {"p50": 100.0}}
    entry.metrics = {
        "perplexity": 20.0 + ppl_pct,
        "perplexity_increase_pct": ppl_pct,
        "generation_ms": short_ms,
        "generation": generation,
        "decode_speedup": 4.0,
        "requests": {
            "64x64": {"request_ms": short_ms, "generation": generation, "decode_speedup": 4.0},
            "1024x128": {"request_ms": long_ms, "generation": generation, "decode_speedup": 3.0},
        },
    }
    entry.size_mb = 100.0
    return entry


def test_the_lm_race_ranks_by_weighted_served_request_time_over_the_declared_shapes():
    requests = [{"prompt": 64, "output": 64, "weight": 0.5}, {"prompt": 1024, "output": 128, "weight": 0.5}]
    base = {"requests": {"64x64": {"request_ms": 3000.0}, "1024x128": {"request_ms": 9000.0}}}

    def one_client(entry: Entry, short_ms: float, long_ms: float) -> Entry:
        cells = {"64x64": short_ms, "1024x128": long_ms}
        entry.metrics["served"] = {k: {"1": {"request_ms": ms, "failed": 0}} for k, ms in cells.items()}
        return entry

    def race(reqs):
        # Decodes faster (short chat wins) but prefills a long prompt slowly, against the balanced one.
        entries = [
            one_client(_lm("fast_decode", 500.0, 4000.0), 500.0, 4000.0),
            one_client(_lm("fast_prefill", 700.0, 2500.0), 700.0, 2500.0),
        ]
        if len(reqs) == 1:
            for entry in entries:
                del entry.metrics["served"]["1024x128"]
        cfg = OmegaConf.create(
            {
                "gate": {"max_ppl_increase_pct": 15.0, "request_shape": None},
                "evaluate": {"batch_sizes": [1]},
                "workload": {"requests": reqs, "concurrency": [1]},
            }
        )
        winner = race_lm.choose(entries, workload.resolve(cfg), base, _thresholds(cfg))
        return winner.name, entries

    name, entries = race(requests)
    # At one level the served cost is the weighted request time over the best candidate's.
    assert name == "fast_prefill" and entries[1].cost == pytest.approx(1600.0 / 1600.0)
    assert entries[0].cost == pytest.approx(2250.0 / 1600.0)
    assert entries[0].outcome == "lost: 1.41x the winner's served cost"
    assert {"TTFT ms 1024x128", "decode tok/s 1024x128", "request ms 1024x128"} <= set(entries[0].columns())
    name, entries = race(requests[:1])  # one 64-token prompt, 64 tokens
    assert name == "fast_decode" and entries[1].outcome == "lost: 1.40x the winner's served cost"
    # Slower than the baseline's one request at a time, at one client: it cannot win over one that is not.
    entries = [one_client(_lm("slow", 400.0, 0.0), 400.0, 9500.0), one_client(_lm("ok", 900.0, 0.0), 900.0, 8000.0)]
    cfg = OmegaConf.create(
        {
            "gate": {"max_ppl_increase_pct": 15.0, "request_shape": None},
            "evaluate": {"batch_sizes": [1]},
            "workload": {"requests": requests, "concurrency": [1]},
        }
    )
    assert race_lm.choose(entries, workload.resolve(cfg), base, _thresholds(cfg)).name == "ok"
    assert entries[0].slower_than_baseline_at == ["1024x128 tokens at 1 clients"]


def _served(entry: Entry, at_1: tuple[float, float], at_16: tuple[float, float]) -> Entry:
    """Served figures at one shape (64x64): (tokens/s, TTFT p95 ms) at 1 and at 16 clients; a request's
    time is what a closed loop of that many clients measures (clients x output / tokens/s)."""

    def cell(clients, figures):
        rate, ttft = figures
        return {"tokens_per_s": rate, "ttft_p95_ms": ttft, "request_ms": 1e3 * clients * 64 / rate, "failed": 0}

    entry.metrics["served"] = {"64x64": {"1": cell(1, at_1), "16": cell(16, at_16)}}
    return entry


def test_the_declared_concurrency_levels_decide_between_a_static_and_a_continuous_batcher():
    base = {"requests": {"64x64": {"request_ms": 3000.0}}}

    def race(concurrency):
        # ONNX Runtime GenAI answers one client sooner; OpenVINO GenAI batches sixteen continuously
        # (the shape of serve/README.md's measurement: 1.7x one client against 5.6x).
        entries = [
            _served(_lm("ort_static", 500.0, 0.0), (160.0, 60.0), (230.0, 3000.0)),
            _served(_lm("ov_continuous", 600.0, 0.0), (110.0, 70.0), (610.0, 400.0)),
        ]
        entries[1].spec = CANDIDATES["openvino_genai_int4"]
        cfg = OmegaConf.create(
            {
                "gate": {"max_ppl_increase_pct": 15.0, "request_shape": None},
                "evaluate": {"batch_sizes": [1], "task_params": {"prompt_tokens": 64, "new_tokens": 64}},
                "workload": {"requests": None, "concurrency": concurrency},
            }
        )
        winner = race_lm.choose(entries, workload.resolve(cfg), base, _thresholds(cfg))
        return winner, entries

    winner, entries = race({1: 0.9, 16: 0.1})  # mostly one user at a time
    assert winner.name == "ort_static"
    winner, entries = race({1: 0.5, 16: 0.5})  # half the time sixteen at once
    assert winner.name == "ov_continuous"
    # At each level the cost is the request time over the best candidate's there, weighted.
    assert entries[1].cost == pytest.approx(0.5 * 160.0 / 110.0 + 0.5 * 1.0)
    assert entries[0].cost == pytest.approx(0.5 * 1.0 + 0.5 * 610.0 / 230.0)
    assert entries[0].outcome.startswith("lost: ") and "served cost" in entries[0].outcome
    columns = entries[0].columns()  # every candidate at every level
    assert columns["served 1 clients tok/s (TTFT p95 ms)"] == "160 (60)"
    assert columns["served 16 clients tok/s (TTFT p95 ms)"] == "230 (3000)"
    assert columns["serves concurrent requests"] == "static batches of at most 4"
    assert entries[1].columns()["serves concurrent requests"] == "continuous batching"
    from optimize.compile.race.cells import serving

    # By the engine format the method builds: the GGUF carriers serve as their runtimes do.
    assert serving(Entry("g", CANDIDATES["openvino_genai_gguf_kv_u8"])) == "continuous batching"
    assert serving(Entry("o", CANDIDATES["ort_genai_gguf"])) == "static batches of at most 4"


def test_a_candidate_cut_by_successive_halving_keeps_its_first_round_figures_and_says_why():
    base = {"requests": {"64x64": {"request_ms": 3000.0}}}
    entries = [
        _served(_lm("leader", 500.0, 0.0), (130.0, 60.0), (600.0, 400.0)),
        _served(_lm("far_behind", 600.0, 0.0), (40.0, 90.0), (100.0, 4000.0)),
    ]
    entries[1].served_cut, entries[1].cost = "3.50x the leader's served cost after the first round", 3.5
    cfg = OmegaConf.create(
        {
            "gate": {"max_ppl_increase_pct": 15.0, "request_shape": None},
            "evaluate": {"batch_sizes": [1]},
            "workload": {"requests": None, "concurrency": [1, 16]},
        }
    )
    winner = race_lm.choose(entries, workload.resolve(cfg), base, _thresholds(cfg))
    assert winner.name == "leader" and entries[1].passed is True
    assert (
        entries[1].outcome
        == "lost: cut after the first served round (3.50x the leader's served cost after the first round)"
    )
    assert entries[1].columns()["served cost (1 = best at every level)"] == "3.50"
    from optimize.compile.race.report import cut_note

    note = cut_note({"cut": {"far_behind": entries[1].served_cut}})
    assert note.startswith("successive halving cut 1 candidate(s) after the first served round (far_behind: 3.50x")


def test_the_per_level_table_shows_every_candidate_at_every_level():
    from optimize.compile.race.report import level_table

    entries = [
        _served(_lm("ort_static", 500.0, 0.0), (160.0, 60.0), (230.0, 3000.0)),
        _served(_lm("ov_continuous", 600.0, 0.0), (110.0, 70.0), (610.0, 400.0)),
    ]
    entries[0].cost, entries[1].cost = 1.83, 1.23
    race = {
        "workload": {"requests": [{"prompt": 64, "output": 64}], "concurrency": {"1": 0.5, "16": 0.5}},
        "candidates": [{**e.report(), "outcome": "won" if i else "lost"} for i, e in enumerate(entries)],
    }
    rows = level_table(race)
    assert rows[0] == ["candidate", "clients", "64x64 tok/s (TTFT p95 ms)", "served cost", "outcome"]
    assert rows[1:] == [
        ["ort_static", "1", "160 (60)", "1.83", "lost"],
        ["ort_static", "16", "230 (3000)", "1.83", "lost"],
        ["ov_continuous", "1", "110 (70)", "1.23", "won"],
        ["ov_continuous", "16", "610 (400)", "1.23", "won"],
    ]


def test_a_grounded_shape_has_its_own_column_read_under_its_own_key():
    from optimize.compile.race.report import level_table

    entry = _served(_lm("prompt_lookup", 500.0, 0.0), (240.0, 84.0), (250.0, 900.0))
    entry.metrics["served"]["grounded:96x64"] = entry.metrics["served"].pop("64x64")
    entry.cost = 1.0
    race = {
        "workload": {
            "requests": [{"prompt": 96, "output": 64, "weight": 1.0, "kind": "grounded"}],
            "concurrency": {"1": 1.0},
        },
        "candidates": [{**entry.report(), "outcome": "won"}],
    }
    rows = level_table(race)
    assert rows[0][2] == "grounded:96x64 tok/s (TTFT p95 ms)"
    assert rows[1] == ["prompt_lookup", "1", "240 (84)", "1.00", "won"]


def test_the_report_command_prints_a_race_and_refuses_anything_else_in_one_line(tmp_path, capsys):
    import json

    from engines.artifact import MANIFEST, SCHEMA_VERSION, seal
    from optimize.compile.race.report import main

    entry = _served(_lm("ov_continuous", 600.0, 0.0), (110.0, 70.0), (610.0, 400.0))
    entry.cost = 1.0
    race = {
        "seconds": 42.0,
        "winner": "ov_continuous",
        "workload": {"requests": [{"prompt": 64, "output": 64}], "concurrency": {"1": 0.5, "16": 0.5}},
        "candidates": [{**entry.report(), "outcome": "won"}],
    }

    def sealed(stages: dict) -> str:
        manifest = {"schema_version": SCHEMA_VERSION, "duration_s": 60.0, "stages": stages, "files": []}
        (tmp_path / MANIFEST).write_text(json.dumps(seal(manifest)))
        return str(tmp_path)

    def refused(argv: list[str]) -> str:
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1, error
        return error

    assert main([sealed({"engine": race})]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "race 42 s of the run's 60 s; won by ov_continuous"
    assert printed[3].split() == ["ov_continuous", "1", "110", "(70)", "1.00", "won"]
    assert refused([]) == "error: usage: python -m optimize.compile.race.report ARTIFACT\n"
    assert refused([str(tmp_path / "none")]) == f"error: {tmp_path / 'none'} is not a directory\n"
    not_a_race = "its engine was not chosen by a race (no race in the manifest's stages)\n"
    assert refused([sealed({"engine": {"format": "onnx"}})]).endswith(not_a_race)
    assert refused([sealed({})]).endswith(not_a_race)
    malformed = {**race, "candidates": [{"name": "x"}]}  # sealed again after an edit: its digest still matches
    assert "the manifest's race record is malformed (KeyError" in refused([sealed({"engine": malformed})])


def test_the_baseline_figures_are_kept_under_what_they_were_measured_on(tmp_path, monkeypatch):
    from optimize.compile.race import cache

    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path))
    what = {"data": {"sha256": "ab"}, "shapes": ["64x64"], "runs": 5, "threads": 0}
    key = cache.baseline_key("model-and-machine", what)
    assert cache.load_baseline(key) is None
    cache.save_baseline(key, {"perplexity": 18.2, "requests": {"64x64": {"ttft_ms": {"p50": 40.0}}}})
    assert cache.load_baseline(key)["perplexity"] == 18.2
    assert cache.baseline_key("model-and-machine", {**what, "shapes": ["64x64", "1024x128"]}) != key
    assert cache.baseline_key("another-cpu", what) != key


def test_the_default_lm_rows_serve_with_the_kv_cache_the_shipped_engine_config_uses():
    """The race times and ships what recipes/engine/openvino_genai_int4.yaml would build: every default
    OpenVINO GenAI row computes in that config's precision and serves with its KV cache."""
    from pathlib import Path

    import yaml

    from optimize.compile.openvino_genai import OVGenAIConfig
    from optimize.compile.race.candidates import default_candidates

    shipped = yaml.safe_load((Path(__file__).parents[2] / "recipes/engine/openvino_genai_int4.yaml").read_text())
    shipped = OVGenAIConfig(**shipped["params"])
    for gguf in (False, True):
        names = default_candidates(generates=True, gguf=gguf)
        rows = [CANDIDATES[n] for n in names if CANDIDATES[n].engine == "openvino_genai"]
        assert len(rows) == 3
        for row in rows:
            cfg = OVGenAIConfig(**row.engine_params)
            assert (cfg.inference_precision, cfg.serving()) == (shipped.inference_precision, shipped.serving())
    # The shipped config is the GGUF source's mixed row (from full precision GPTQ replaces scale estimation).
    assert any(OVGenAIConfig(**row.engine_params) == shipped for row in rows)
    # The f32-KV builds stay to be measured by name.
    assert OVGenAIConfig(**CANDIDATES["openvino_genai_int4_awq"].engine_params).serving()["kv_cache_precision"] == "f32"


def test_a_served_load_that_failed_is_reported_with_its_level_and_first_error():
    """A request that failed makes the served cost infinite; the cut, the outcome and the tables say
    where it failed and with what error, not only "inf x the leader's"."""
    from optimize.compile.race.report import cut_note, level_table
    from optimize.compile.race.served import cut_reason, served_costs

    cfg = OmegaConf.create(
        {
            "gate": {"max_ppl_increase_pct": 15.0, "request_shape": None},
            "evaluate": {"batch_sizes": [1], "task_params": {"prompt_tokens": 64, "new_tokens": 64}},
            "workload": {"requests": None, "concurrency": [1, 16]},
        }
    )
    load = workload.resolve(cfg)
    leader = _served(_lm("leader", 500.0, 0.0), (130.0, 60.0), (600.0, 400.0))
    failing = _served(_lm("failing", 600.0, 0.0), (150.0, 50.0), (700.0, 300.0))
    error = "ReadTimeout: timed out"
    failing.metrics["served"]["64x64"]["16"] = {
        "tokens_per_s": 500.0,
        "ttft_p95_ms": 900.0,
        "request_ms": None,
        "requests": 16,
        "failed": 3,
        "errors": [error],
    }
    costs = served_costs([leader, failing], load)
    assert costs["failing"] == float("inf")
    why = cut_reason(failing, load, costs["failing"] / costs["leader"])
    assert why == f"its served load failed: 3/16 requests failed at 16 client(s), shape 64x64: {error}"
    assert cut_note({"cut": {"failing": why}}).endswith(f"(failing: {why})")
    # Timed to the end (no cut: one candidate left, or the second round): its outcome says it too.
    winner = race_lm.choose([leader, failing], load, {"requests": {"64x64": {"request_ms": 3000.0}}}, _thresholds(cfg))
    assert winner.name == "leader"
    assert failing.outcome.endswith(
        f"(its served load failed: 3/16 requests failed at 16 client(s), shape 64x64: {error})"
    )
    assert failing.columns()["served 16 clients tok/s (TTFT p95 ms)"] == "failed 3/16"
    race = {
        "workload": {"requests": [{"prompt": 64, "output": 64}], "concurrency": {"1": 0.5, "16": 0.5}},
        "candidates": [failing.report()],
    }
    assert level_table(race)[2][2] == "failed 3/16"


def test_decode_speed_as_served_is_read_from_gaps_or_else_from_the_mean_request():
    from optimize.compile.race.lm import _served_decode

    cell = {"request_ms": 100.0, "ttft_p50_ms": 20.0, "itl_p50_ms": 5.0, "requests": 4, "output_tokens": 36}
    assert _served_decode(cell) == (200.0, "inter-token gap p50")
    # No gaps (every reply one chunk): 8 tokens after the first in the 80 ms after it.
    assert _served_decode(dict(cell, itl_p50_ms=None)) == (pytest.approx(100.0), "mean request after the first token")
    # No text at all (tokens that detokenize to nothing): the whole request, prefill included.
    silent = dict(cell, itl_p50_ms=None, ttft_p50_ms=None)
    assert _served_decode(silent) == (pytest.approx(90.0), "mean request, prefill included")
    assert _served_decode(dict(cell, request_ms=None)) == (None, "")
    assert _served_decode(dict(silent, output_tokens=0)) == (None, "")


def test_an_engine_served_one_sequence_at_a_time_is_driven_at_the_fewest_clients_and_the_rest_derived():
    from optimize.compile.race.served import _with_derived, derived_cell, driven_levels

    cfg = OmegaConf.create(
        {
            "gate": {"request_shape": None},
            "evaluate": {"batch_sizes": [1], "task_params": {"prompt_tokens": 64, "new_tokens": 64}},
            "workload": {"requests": None, "concurrency": [1, 4, 16]},
        }
    )
    load = workload.resolve(cfg)
    from types import SimpleNamespace

    # The GGUF method builds either format (native kernels where the CPU has AVX2): the built one decides.
    native, batched = Entry("native", CANDIDATES["gguf_q8_0"]), Entry("ov", CANDIDATES["gguf_q8_0_openvino"])
    native.model = SimpleNamespace(engine={"format": "native-gguf"}, precision="int8")
    batched.model = SimpleNamespace(engine={"format": "openvino-genai"}, precision="int8")
    assert [c.clients for c in driven_levels(native, load)] == [1]
    assert [c.clients for c in driven_levels(batched, load)] == [1, 4, 16]
    one = {"tokens_per_s": 20.0, "request_ms": 3200.0, "ttft_p50_ms": 150.0, "ttft_p95_ms": 180.0, "failed": 0}
    cells = _with_derived({"64x64": {"1": one}}, load, driven_levels(native, load))
    assert list(cells["64x64"]) == ["1", "4", "16"] and cells["64x64"]["1"] is one
    sixteen = cells["64x64"]["16"]
    # A closed loop of 16 clients on a first-come server: a request's time is 16 requests' own; a first
    # token waits for none to 15 of the others (the median 7.5 of them, the 95th percentile 14.25).
    assert sixteen["request_ms"] == 16 * 3200.0 and sixteen["tokens_per_s"] == 20.0
    assert sixteen["ttft_p50_ms"] == 150.0 + 7.5 * 3200.0 and sixteen["ttft_p95_ms"] == 180.0 + 14.25 * 3200.0
    assert sixteen["derived"].startswith("16 clients from 1")
    assert cells["64x64"]["4"]["request_ms"] == 4 * 3200.0
    # A failure measured at the fewest clients stays a failure at every level.
    failed = derived_cell({"request_ms": None, "failed": 2, "requests": 2, "errors": ["boom"]}, 1, 16)
    assert failed["request_ms"] is None and failed["errors"] == ["boom"]
    from optimize.compile.race.cells import served_cell

    assert served_cell(sixteen) == "20 (45780) derived" and served_cell(one) == "20 (180)"


def test_the_second_served_round_fits_each_cell_in_its_budget_by_the_first_rounds_pace(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from optimize.compile.race import served

    assert served.SECOND_ROUND_CELL_BUDGET_S == 60.0
    quick = {"requests": 2, "wall_s": 3.0, "request_ms": 1500.0}  # SmolLM2's pace: as many as asked
    assert served.second_round_requests(quick, 1) == 8
    slow = {"requests": 2, "wall_s": 32.0, "request_ms": 16000.0}  # 16 s a request: three fit in 60 s
    assert served.second_round_requests(slow, 1) == 3
    crowded = {"requests": 16, "wall_s": 165.0, "request_ms": 165000.0}  # one round of 16 took 165 s
    assert served.second_round_requests(crowded, 16) is None
    failed = {"requests": 2, "wall_s": 1.0, "request_ms": None}
    assert served.second_round_requests(failed, 1) == 8

    class Server:  # each request from each client takes `pace` seconds of wall
        sent: list = []

        def __init__(self, folder, threads):
            pass

        def start(self, warm):
            pass

        def drive(self, prompts, clients, per_client, output):
            Server.sent.append((clients, per_client))
            pace = 16.0 if clients == 1 else 165.0
            return {"clients": clients, "wall_s": pace * per_client, "requests": clients * per_client,
                    "failed": 0, "tokens_per_s": 10.0, "ttft_p95_ms": 5.0}  # fmt: skip

        def stop(self):
            pass

    monkeypatch.setattr(served, "_Server", Server)
    monkeypatch.setattr(served, "_artifact", lambda entry, ctx: tmp_path)
    cfg = OmegaConf.create(
        {
            "gate": {"request_shape": None},
            "evaluate": {"batch_sizes": [1], "task_params": {"prompt_tokens": 64, "new_tokens": 64}},
            "workload": {"requests": None, "concurrency": [1, 16]},
        }
    )
    load = workload.resolve(cfg)
    entry = Entry("ov", CANDIDATES["gguf_q8_0_openvino"])
    entry.model = SimpleNamespace(engine={"format": "openvino-genai"}, precision="int8")
    ctx = SimpleNamespace(threads=2)
    prompts = {"64x64": [[1, 2, 3]]}
    entry.metrics = {"served": served._serve_cells(entry, ctx, load, prompts, 1)}
    assert Server.sent == [(1, 2), (16, 1)]
    second = served._serve_cells(entry, ctx, load, prompts, 2)
    assert Server.sent[2:] == [(1, 3)]  # 16 s a request: 3 fit; sixteen clients' 165 s is not driven again
    assert second["64x64"]["16"] == {**entry.metrics["served"]["64x64"]["16"], "kept_from_round": 1}
    assert second["64x64"]["1"]["requests"] == 3


def test_the_races_server_is_stopped_however_a_served_round_ends(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from optimize.compile.race import served

    stopped = []

    class Server:
        def __init__(self, folder, threads):
            pass

        def start(self, warm):
            if fail_start:
                raise RuntimeError("the server exited: no engine")

        def drive(self, prompts, clients, per_client, output):
            raise KeyboardInterrupt  # Ctrl-C while the clients wait

        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(served, "_Server", Server)
    monkeypatch.setattr(served, "_artifact", lambda entry, ctx: tmp_path / "served")
    cfg = OmegaConf.create(
        {
            "gate": {"request_shape": None},
            "evaluate": {"batch_sizes": [1], "task_params": {"prompt_tokens": 64, "new_tokens": 64}},
            "workload": {"requests": None, "concurrency": [1]},
        }
    )
    entry = Entry("ov", CANDIDATES["gguf_q8_0_openvino"])
    entry.model = SimpleNamespace(engine={"format": "openvino-genai"}, precision="int8")
    args = (entry, SimpleNamespace(threads=2), workload.resolve(cfg), {"64x64": [[1, 2, 3]]}, 1)
    fail_start = False
    with pytest.raises(KeyboardInterrupt):
        served._serve_cells(*args)
    assert stopped == [True]
    fail_start = True  # a server that never became ready: recorded as failed cells, and stopped
    cells = served._serve_cells(*args)
    assert cells["64x64"]["1"]["request_ms"] is None and "no engine" in cells["64x64"]["1"]["errors"][0]
    assert stopped == [True, True]
