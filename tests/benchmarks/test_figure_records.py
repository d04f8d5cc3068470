"""`--record PATH`: each benchmark that produces a headline figure turns its result into a row of
docs/figures.md's table (checked against the records' schema and rendered), and a record it could not
write is refused before anything runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from optimize.docs import figures


def recorded(tmp_path: Path, module: str, fields: dict) -> str:
    """The table row of `fields` once written as a record by `module`: the record passes the schema."""
    path = tmp_path / "record.json"
    figures.write_record(path, module=f"benchmarks.{module}", argv=["X", "--record", str(path)], **fields)
    record = figures.validate(json.loads(path.read_text()), str(path))
    assert record["command"] == f"python -m benchmarks.{module} X --record {path}"
    return figures.table([("record", record)]).splitlines()[2]


def test_the_single_user_record(tmp_path):
    from benchmarks import llamacpp_single_user

    args = argparse.Namespace(gguf=Path("m.Q4_1.gguf"), prompt=1024, tokens=128, threads=1, rounds=3)
    result = {"median_native_ttft_s": 9.98, "median_native_decode_tok_s": 38.7, "median_ttft_ratio": 0.395,
              "median_server_ttft_s": 25.57, "median_ttft_cpu_ratio": 0.337, "median_decode_ratio": 1.85,
              "median_bench_tg_tok_s": 22.1}  # fmt: skip
    row = recorded(tmp_path, "llamacpp_single_user", llamacpp_single_user.record_fields(args, result))
    assert "a 1024-token prompt then 128 new tokens greedily, 1 thread, medians of 3 rounds" in row
    assert "**time to first token 9.98 s, decode 38.7 tok/s**" in row
    assert "TTFT 0.395x llama-server's (25.57 s; 0.337x in CPU seconds); decode 1.85x llama-bench tg128" in row


def test_the_decode_in_turns_record(tmp_path):
    from benchmarks import llamacpp

    manifest = {"engine": {"format": "native_gguf"}, "recipe": {"name": "smollm2_int4_cpu"}}
    args = argparse.Namespace(tokens=64, rounds=2)
    result = {"median_artifact": 288.5, "median_ratio": 1.2034, "llama_bench_args": ["-ub", "1"],
              "rounds": [{"llama_bench": 233.0, "artifact": 290.0, "ratio": 1.245},
                         {"llama_bench": 252.0, "artifact": 287.0, "ratio": 1.139}]}  # fmt: skip
    row = recorded(tmp_path, "llamacpp", llamacpp.record_fields(manifest, args, Path("f.gguf"), result))
    assert "The native_gguf artifact of smollm2_int4_cpu decoding one sequence" in row
    assert "**288.5 tok/s** | 1.203x llama-bench tg64 (1.139-1.245 by round; llama-bench 233-252 tok/s, -ub 1)" in row


def test_the_perplexity_record(tmp_path):
    from benchmarks import llamacpp_perplexity

    manifest = {"engine": {"format": "native_gguf"}, "recipe": {"name": "smollm2_int4_cpu"}}
    result = {"tokens": 2044, "baseline_perplexity": 18.1685, "artifact_perplexity": 18.1688,
              "artifact_increase_over_baseline_pct": 0.0014, "gguf": "f.gguf", "ran_with": "repacked",
              "perplexity": 18.277, "increase_over_baseline_pct": 0.597}  # fmt: skip
    row = recorded(tmp_path, "llamacpp_perplexity", llamacpp_perplexity.record_fields(manifest, result))
    assert "**18.1688 (+0.0014%)** | llama.cpp on the same file (f.gguf, repacked): 18.2770 (+0.60%)" in row


def test_the_kld_record(tmp_path):
    from benchmarks import llamacpp_kld

    args = argparse.Namespace(runner="q8-activations", top_k=0, ctx=512)
    result = {"tokens": 4096, "chunks": 8, "ratio": {"Q8_0": 0.804, "Q4_0": 0.974},
              "project": {"Q8_0": {"mean_kld": 0.00373}, "Q4_0": {"mean_kld": 0.304}},
              "llama_cpp": {"Q8_0": {"mean_kld": 0.00464}, "Q4_0": {"mean_kld": 0.312}}}  # fmt: skip
    row = recorded(tmp_path, "llamacpp_kld", llamacpp_kld.record_fields(args, result))
    assert "(8-bit activations as llama.cpp rounds them, whole vocabulary)" in row
    assert "**Q8_0 0.00373, Q4_0 0.304** | Q8_0 0.80x llama.cpp's (0.00464), Q4_0 0.97x llama.cpp's (0.312)" in row


def test_the_gguf_writer_record_names_the_files_that_differ(tmp_path):
    from benchmarks import gguf_export_check

    same = {"tensors": 272, "same_type": 272, "same_bytes": 272, "differ": []}
    result = {"llama_quantize": {"Q8_0": same, "Q4_0": same, "Q4_0-imatrix": same}}
    row = recorded(tmp_path, "gguf_export_check", gguf_export_check.record_fields(Path("/m/smollm2"), result))
    assert "on smollm2: Q8_0, Q4_0, and Q4_0 with the same importance matrix" in row
    assert "**3 of 3 files: the same type and the same bytes in all 272 tensors** | identical to" in row

    result["llama_quantize"]["Q4_0"] = {**same, "same_bytes": 271, "differ": ["blk.0.ffn_down.weight: ..."]}
    row = recorded(tmp_path, "gguf_export_check", gguf_export_check.record_fields(Path("/m/smollm2"), result))
    assert "**2 of 3 files: the same type and the same bytes in all 272 tensors (not: Q4_0)** |  |" in row


def test_the_openai_client_record(tmp_path):
    from benchmarks import serve_llm_apps

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "manifest.json").write_text(json.dumps({"recipe": {"name": "smollm2_int4_cpu"}}))
    args = argparse.Namespace(artifact=artifact, max_tokens=128)
    report = {
        "engine": "openvino_genai",
        "checks": [{"check": "parse", "passed": True}, {"check": "n", "passed": False}],
    }
    row = recorded(tmp_path, "serve_llm_apps", serve_llm_apps.record_fields(args, report))
    assert "(parse, n), greedy, max_tokens 128, on the openvino_genai artifact of smollm2_int4_cpu" in row
    assert "**1 of 2 checks passed (failed: n)** |  |" in row


def test_the_served_load_record_against_each_peer_that_ran(tmp_path):
    from benchmarks import serve_llm_load

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    manifest = {"engine": {"format": "openvino_genai"}, "recipe": {"name": "smollm2_int4_cpu"}}
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    args = argparse.Namespace(artifact=artifact, levels=[1, 16], prompt_tokens=64, new_tokens=64, rounds=3)

    def levels(*figures):
        return {"levels": [{"clients": c, "tokens_per_s": t} for c, t in figures]}

    report = {"servers": {"serve, continuous batching": levels((1, 94.2), (16, 639.7)),
                          "llama.cpp llama-server (-np = clients)": levels((1, 184.0), (16, 200.6)),
                          "vLLM CPU server (bf16)": levels((1, 29.8), (16, 337.1))}}  # fmt: skip
    row = recorded(tmp_path, "serve_llm_load", serve_llm_load.record_fields(args, report))
    assert "served to 16 clients, 64-token prompts, 64 new tokens, medians of 3 rounds" in row
    assert "**639.7 tok/s (94.2 at 1 client)** | 3.19x llama.cpp's llama-server (200.6 tok/s), 1.90x vLLM" in row

    del report["servers"]["vLLM CPU server (bf16)"]
    assert serve_llm_load.record_fields(args, report)["ratio"] == "3.19x llama.cpp's llama-server (200.6 tok/s)"
    del report["servers"]["serve, continuous batching"]
    assert serve_llm_load.record_fields(args, report) is None


def test_the_encoder_peers_record(tmp_path):
    from benchmarks import peers

    def entry(name, role, b1, b32):
        return peers.Entry(name, role, lambda: None, "", {"cosine_min": 1.0}, {"1": b1, "32": b32})

    entries = [entry("PyTorch FP32", "baseline", 31.08, 682.8), entry(peers.ARTIFACT, "artifact", 10.97, 224.9),
               entry("OpenVINO bf16", "peer", 14.01, 278.0)]  # fmt: skip
    table = peers.ratios(entries, ["1", "32"])
    mix = peers.weighted(entries, {"1": 0.5, "32": 0.5})
    row = recorded(tmp_path, "peers", peers.record_fields("minilm_int8_cpu: openvino int8+bf16", entries, table, mix))
    assert "p50 latency at batch 1 / batch 32 / weighted" in row
    assert "**10.97 ms / 224.90 ms / 117.9 ms** | 1.28x / 1.24x / 1.24x the best eligible peer (OpenVINO bf16" in row


@pytest.mark.parametrize(
    ("module", "argv", "fragment"),
    [
        ("serve_llm_load", ["{dir}", "--record", "{dir}/no/such/x.json"], "there is no folder"),
        ("serve_llm_load", ["{dir}", "--servers", "llamacpp", "--record", "{dir}/x.json"], "add batching"),
        ("llamacpp", ["{dir}", "--record", "{dir}/x.json"], "give --rounds N"),
        ("llamacpp_kld", ["--project-only", "--also", "Q5_0", "--record", "{dir}/x.json"], "drop --project-only"),
        ("serve_llm_apps", ["{dir}", "--record", "{dir}"], "is a folder"),
    ],
)
def test_a_record_that_cannot_be_written_is_refused_before_anything_runs(module, argv, fragment, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(dir=tmp_path) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "x.json").exists()


def test_the_option_writes_only_when_given(tmp_path):
    from benchmarks import figure_record

    parser = argparse.ArgumentParser()
    figure_record.add_option(parser)
    fields = {"measure": "m", "figure": "1 tok/s", "ratio": None}
    figure_record.write(parser.parse_args([]), "benchmarks.x", [], **fields)
    assert list(tmp_path.iterdir()) == []
    path = tmp_path / "x.json"
    figure_record.write(parser.parse_args(["--record", str(path)]), "benchmarks.x", ["--record", str(path)], **fields)
    assert json.loads(path.read_text())["command"] == f"python -m benchmarks.x --record {path}"
