"""One user on one GGUF file: the native GGUF engine against llama.cpp, in turns.

    .venv/bin/python -m benchmarks.llamacpp_single_user GGUF [--rounds 5] [--threads 2] [--prompt 1024]
        [--tokens 128] [--llama-server PATH] [--llama-bench PATH] [--kv-cache f16] [--json OUT]

The single-user workload: one client, a `--prompt`-token prompt, `--tokens` new tokens. Each round
measures, in an order reversed every other round (on a shared machine either side's speed moves with
the minute, so neither always runs on the other's warm or cold caches):
  - llama-server (started once: one slot, `--threads` threads, its prompt cache off per request) answering
    a streamed completion of the prompt's token ids: the time to its first token as the client sees it,
    and its decode tokens/s (its own timings);
  - the native engine (engines/native_gguf, in this process) reading the same ids and generating as
    many tokens greedily: its time to the first token and its decode tokens/s after it;
  - llama-bench's tg`--tokens` (no prompt, one repetition a round): llama.cpp's own decode reference.
It prints each round and the medians with the ratios (time to first token: the engine's over
llama-server's, lower is better; decode: the engine's over llama-bench's). Beside the wall-clock
figures it records the CPU seconds each side spent to its first token and on its decode (the
server's from /proc, the engine's from this process): on a machine other work keeps busy, the wall
clock measures the scheduler as much as the engines, the CPU seconds much less so. Programs are found as
benchmarks/llamacpp.py finds them (flag, $PEERS_LLAMA_SERVER / $PEERS_LLAMA_BENCH, PATH); bad counts
and files are refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import figure_record
from benchmarks.artifact_input import refuse, refuse_unwritable
from benchmarks.llamacpp import decode_reference, find_tool
from serve.arguments import OneLineParser

MAX_ROUNDS = 100
MAX_PROMPT = 32768
MAX_TOKENS = 4096


def prompt_ids(vocab: int, length: int, seed: int = 0) -> list[int]:
    """A seeded prompt of token ids away from either end of the vocabulary (special tokens sit there)."""
    import numpy as np

    low, high = min(100, vocab // 4), max(vocab - 100, vocab * 3 // 4)
    return [int(i) for i in np.random.default_rng(seed).integers(low, high, length)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat, clock ticks)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class LlamaServer:
    """llama-server on `gguf` with one slot, started and waited for (its /health), stopped on exit."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int):
        self.port = free_port()
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                        "-np", "1", "-c", str(context), "-t", str(threads), "-tb", str(threads)]  # fmt: skip
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> LlamaServer:
        import urllib.request

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.process.stderr.read() if self.process.stderr else "").strip().splitlines()[-1:]
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {' '.join(tail)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server did not answer /health within 300 s")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def completion(self, ids: list[int], tokens: int) -> dict:
        """A streamed greedy completion: {"ttft_s", "decode_tok_s", "tokens", "ttft_cpu_s", "decode_cpu_s"}."""
        import http.client

        body = json.dumps({"prompt": ids, "n_predict": tokens, "stream": True, "cache_prompt": False,
                           "temperature": 0.0, "ignore_eos": True})  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        cpu_start = cpu_seconds(self.process.pid)
        start = time.perf_counter()
        connection.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        first, cpu_first = None, 0.0
        timings: dict = {}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if first is None and event.get("content") is not None:
                first = time.perf_counter() - start
                cpu_first = cpu_seconds(self.process.pid)
            timings = event.get("timings") or timings
        connection.close()
        cpu_end = cpu_seconds(self.process.pid)
        if first is None or not timings:
            raise RuntimeError("llama-server's stream held no token or no timings")
        return {"ttft_s": first, "decode_tok_s": float(timings["predicted_per_second"]),
                "tokens": int(timings["predicted_n"]), "ttft_cpu_s": cpu_first - cpu_start,
                "decode_cpu_s": cpu_end - cpu_first}  # fmt: skip


def native_completion(model, ids: list[int], tokens: int) -> dict:
    """The native engine's greedy generation of `tokens` after `ids`: time to the first token (the
    prompt's passes and its logits' argmax) and decode tokens/s after it."""
    import numpy as np

    cpu_start, start = time.process_time(), time.perf_counter()
    token = int(np.argmax(model.forward(ids, 0, every=False)[-1]))
    first, cpu_first = time.perf_counter() - start, time.process_time()
    position = len(ids)
    for _ in range(tokens - 1):
        token = int(np.argmax(model.step(token, position)))
        position += 1
    decode = (tokens - 1) / max(time.perf_counter() - start - first, 1e-9)
    return {"ttft_s": first, "decode_tok_s": decode, "tokens": tokens, "ttft_cpu_s": cpu_first - cpu_start,
            "decode_cpu_s": time.process_time() - cpu_first}  # fmt: skip


def measure(args: argparse.Namespace, server_binary: Path, bench_binary: Path) -> dict:
    from engines.native_gguf.model import NativeGGUF

    context = args.prompt + args.tokens + 64
    model = NativeGGUF(args.gguf, context=context, threads=args.threads, kv_cache=args.kv_cache)
    ids = prompt_ids(model.hyper.vocab, args.prompt)
    with LlamaServer(server_binary, args.gguf, args.threads, context) as server:
        server.completion(ids[:64], 4)  # each side warmed once before anything is timed
        native_completion(model, ids[:64], 4)
        runs = {
            "llama_server": lambda: server.completion(ids, args.tokens),
            "native": lambda: native_completion(model, ids, args.tokens),
            "llama_bench": lambda: decode_reference(bench_binary, args.gguf, args.threads, args.tokens, 1),
        }
        rows = []
        for number in range(args.rounds):
            order = list(runs) if number % 2 == 0 else list(runs)[::-1]
            seen = {name: runs[name]() for name in order}
            row = {
                "server_ttft_s": round(seen["llama_server"]["ttft_s"], 3),
                "server_decode_tok_s": round(seen["llama_server"]["decode_tok_s"], 1),
                "native_ttft_s": round(seen["native"]["ttft_s"], 3),
                "native_decode_tok_s": round(seen["native"]["decode_tok_s"], 1),
                "bench_tg_tok_s": round(seen["llama_bench"]["median_tokens_per_s"], 1),
            }
            for side, name in (("server", "llama_server"), ("native", "native")):
                row[f"{side}_ttft_cpu_s"] = round(seen[name]["ttft_cpu_s"], 2)
                row[f"{side}_decode_cpu_s"] = round(seen[name]["decode_cpu_s"], 2)
            row["ttft_ratio"] = round(row["native_ttft_s"] / row["server_ttft_s"], 3)
            row["ttft_cpu_ratio"] = round(row["native_ttft_cpu_s"] / max(row["server_ttft_cpu_s"], 0.01), 3)
            row["decode_ratio"] = round(row["native_decode_tok_s"] / row["bench_tg_tok_s"], 3)
            rows.append(row)
            print(f"round {number + 1}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    model.close()
    medians = {f"median_{k}": round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    return {"gguf": str(args.gguf), "threads": args.threads, "prompt_tokens": args.prompt,
            "new_tokens": args.tokens, "kv_cache": args.kv_cache, "rounds": rows, **medians}  # fmt: skip


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__.split("\n\n")[1].strip())
    p.add_argument("gguf", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--kv-cache", default="f16", choices=("f16", "f32"))
    p.add_argument("--llama-server", default=None)
    p.add_argument("--llama-bench", default=None)
    p.add_argument("--json", type=Path)
    figure_record.add_option(p)
    args = p.parse_args(argv)
    refuse_unwritable(args.json, args.record)
    # SIGTERM unwinds like Ctrl-C: llama-server and llama-bench are stopped, not left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for flag, value, high in (("--rounds", args.rounds, MAX_ROUNDS), ("--prompt", args.prompt, MAX_PROMPT),
                              ("--tokens", args.tokens, MAX_TOKENS), ("--threads", args.threads, 1024)):  # fmt: skip
        if not 1 <= value <= high:
            refuse(f"{flag} {value}: from 1 to {high}")
    if args.gguf.suffix != ".gguf" or not args.gguf.is_file():
        refuse(f"{args.gguf}: no such .gguf file")
    server, why = find_tool(args.llama_server, "PEERS_LLAMA_SERVER", "llama-server", "--llama-server")
    bench, why_bench = find_tool(args.llama_bench, "PEERS_LLAMA_BENCH", "llama-bench", "--llama-bench")
    if server is None or bench is None:
        refuse(why or why_bench)
    try:
        result = measure(args, server, bench)
    except RuntimeError as exc:  # a peer failed: one line, not a traceback
        refuse(str(exc))
    print(
        f"medians of {args.rounds} rounds, {args.prompt}-token prompt, {args.tokens} new tokens, {args.threads} "
        f"threads: time to first token llama-server {result['median_server_ttft_s']} s, native "
        f"{result['median_native_ttft_s']} s ({result['median_ttft_ratio']}x); decode llama-bench "
        f"tg{args.tokens} {result['median_bench_tg_tok_s']}, llama-server {result['median_server_decode_tok_s']}, "
        f"native {result['median_native_decode_tok_s']} tok/s ({result['median_decode_ratio']}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.record:
        figure_record.write(args, "benchmarks.llamacpp_single_user", argv, **record_fields(args, result))
    return result


def record_fields(args: argparse.Namespace, result: dict) -> dict:
    """The row of docs/figures.md's table this run measures: the native engine's time to the first token
    and decode for one user, against llama-server's and llama-bench's."""
    threads = f"{args.threads} thread" + ("s" if args.threads > 1 else "")
    return {
        "measure": f"The native GGUF engine for one user: {args.gguf.name}, a {args.prompt}-token prompt then "
        f"{args.tokens} new tokens greedily, {threads}, medians of {args.rounds} rounds in turns",
        "figure": f"time to first token {result['median_native_ttft_s']} s, "
        f"decode {result['median_native_decode_tok_s']} tok/s",
        "ratio": f"TTFT {result['median_ttft_ratio']}x llama-server's ({result['median_server_ttft_s']} s; "
        f"{result['median_ttft_cpu_ratio']}x in CPU seconds); decode {result['median_decode_ratio']}x "
        f"llama-bench tg{args.tokens} ({result['median_bench_tg_tok_s']} tok/s)",
    }


if __name__ == "__main__":
    main()
