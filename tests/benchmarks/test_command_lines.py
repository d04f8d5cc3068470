"""Every benchmark's command line refuses a hostile value (zero, negative, NaN, inf, huge, a malformed
or unknown list item, a missing path) with one line `error: ...` and exit 2, in the parser: before
any server starts, any artifact is read or anything is timed."""

from __future__ import annotations

import importlib

import pytest

HUGE = "9" * 30

CASES = [
    # serve_llm_load: the flags the review found running with nonsense rows, or as tracebacks
    ("serve_llm_load", ["--levels", "0"], "--levels: item '0': must be >= 1"),
    ("serve_llm_load", ["--levels=-1,2"], "--levels: item '-1': must be >= 1"),
    ("serve_llm_load", ["--levels", "1,,4"], "--levels: item ''"),
    ("serve_llm_load", ["--levels", ""], "--levels: give 1 to 64 comma-separated numbers"),
    ("serve_llm_load", ["--timeout-s", "nan"], "--timeout-s: must be a finite number"),
    ("serve_llm_load", ["--timeout-s", "-1"], "--timeout-s: must be > 0"),
    ("serve_llm_load", ["--start-timeout-s", "inf"], "--start-timeout-s: must be a finite number"),
    ("serve_llm_load", ["--servers", "bogus"], "--servers: unknown 'bogus'"),
    ("serve_llm_load", ["--scenarios", "prefix,nope"], "--scenarios: unknown 'nope'"),
    ("serve_llm_load", ["--requests-per-level", "0"], "--requests-per-level: must be >= 1"),
    ("serve_llm_load", ["--structured-share", "2"], "--structured-share: must be <= 1"),
    ("serve_llm_load", ["--structured-share", "nan"], "--structured-share: must be a finite number"),
    ("serve_llm_load", ["--structured-share", "0.01"], "is no client at all"),
    ("serve_llm_load", ["--servers", "vllm", "--structured-share", "0.5"], "add batching to --servers"),
    ("serve_llm_load", ["--rounds", HUGE], "--rounds: must be <= 1000"),
    ("serve_llm_load", ["--threads", "0"], "--threads: must be >= 1"),
    ("serve_llm_load", ["--gguf", "/no/such.gguf"], "--gguf: /no/such.gguf: no such file"),
    ("serve_llm_load", ["--vllm-model", "/no/such"], "--vllm-model: /no/such: no such folder"),
    # serve_fleet
    ("serve_fleet", ["shadow", "--rounds", "0"], "--rounds: must be >= 1"),
    ("serve_fleet", ["shadow", "--seconds", "nan"], "--seconds: must be a finite number"),
    ("serve_fleet", ["shadow", "--clients", "0"], "--clients: must be >= 1"),
    ("serve_fleet", ["bogus"], "invalid choice: 'bogus'"),
    # the rest
    ("serve_bench", ["--rounds", "0"], "--rounds: must be >= 1"),
    ("serve_bench", ["--seconds", "inf"], "--seconds: must be a finite number"),
    ("serve_bench", ["--clients", "-3"], "--clients: must be >= 1"),
    ("serve_bench", ["--text", " "], "--text is empty"),
    ("serve_llm_apps", ["--url", "http://[::1"], "--url: 'http://[::1' is not a URL"),
    ("serve_llm_apps", ["--url", "http://127.0.0.1:99999"], "--url: 'http://127.0.0.1:99999' is not a URL"),
    ("serve_llm_apps", ["--checks", "parse,nonsense"], "--checks: unknown 'nonsense'"),
    ("serve_llm_apps", ["--timeout-s", "inf"], "--timeout-s: must be a finite number"),
    ("serve_llm_apps", ["--top-logprobs", "21"], "--top-logprobs: must be <= 20"),
    ("serve_prompt_lookup", ["--clients", "0"], "--clients: must be >= 1"),
    ("serve_prompt_lookup", ["--prompt-tokens", "7"], "--prompt-tokens: must be >= 8"),
    ("serve_prompt_lookup", ["--per-client", "nan"], "--per-client: not a number"),
    ("openvino_kv_cache", ["--precisions", "u9"], "--precisions: 'u9': the kind is one of"),
    ("openvino_kv_cache", ["--window", "1"], "--window: must be >= 2"),
    ("vllm_perplexity", ["--port", "0"], "--port: must be >= 1"),
    ("vllm_perplexity", ["--tolerance-pct", "nan"], "--tolerance-pct: must be a finite number"),
    ("llamacpp", ["--threads", "x"], "--threads: invalid int value"),
    ("llamacpp_perplexity", ["--threads", "nan"], "--threads: invalid int value"),
]
NAMED = [  # the scripts whose artifact is a flag
    ("peers", ["--batch-sizes", "0,32"], "--batch-sizes: item '0': must be >= 1"),
    ("peers", ["--weights", "1:x"], "--weights: item '1:x': not a number"),
    ("peers", ["--repeats", "0"], "--repeats: must be >= 1"),
    ("peers_lm", ["--window", "1"], "--window: must be >= 2"),
    ("peers_lm", ["--runs", HUGE], "--runs: must be <= 10000"),
    ("ort_int8_variants", ["--retries", "-1"], "--retries: must be >= 0"),
    ("ort_int8_variants", ["--batch-sizes", "1,-32"], "--batch-sizes: item '-32'"),
]


def refusal(module: str, argv: list[str], capsys) -> str:
    script = importlib.import_module(f"benchmarks.{module}")
    parse = getattr(script, "parse_args", None) or script.main
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("module", "argv", "fragment"), CASES)
def test_a_hostile_value_is_one_line_and_exit_2(module, argv, fragment, tmp_path, capsys):
    err = refusal(module, [str(tmp_path), *argv], capsys)
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


@pytest.mark.parametrize(("module", "argv", "fragment"), NAMED)
def test_a_hostile_value_of_a_script_naming_its_artifact_is_one_line(module, argv, fragment, tmp_path, capsys):
    err = refusal(module, ["--artifact", str(tmp_path), *argv], capsys)
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


@pytest.mark.parametrize("module", ["peers", "peers_lm", "ort_int8_variants"])
def test_a_missing_artifact_folder_is_one_line(module, tmp_path, capsys):
    err = refusal(module, ["--artifact", str(tmp_path / "missing")], capsys)
    assert err == f"error: argument --artifact: {tmp_path / 'missing'}: no such folder\n"


def test_a_missing_or_unreadable_artifact_of_the_fleet_benchmark_is_one_line(tmp_path, capsys):
    assert refusal("serve_fleet", [str(tmp_path / "missing"), "shadow"], capsys).startswith(
        f"error: {tmp_path / 'missing'}"
    )
    assert (
        refusal("serve_fleet", [str(tmp_path), "ray"], capsys)
        == f"error: {tmp_path} is not an artifact: no manifest.json\n"
    )


def test_good_values_parse(tmp_path):
    from benchmarks import serve_llm_load

    args = serve_llm_load.parse_args(
        [
            str(tmp_path),
            "--levels",
            "1,4,16",
            "--servers",
            "batching,vllm",
            "--scenarios",
            "",
            "--structured-share",
            "0.5",
        ]
    )
    assert args.levels == [1, 4, 16] and args.servers == ["batching", "vllm"] and args.scenarios == []
    assert args.structured_share == 0.5
