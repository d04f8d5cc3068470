"""Benchmark of serve/ against the two targets in the serve issue:

1. Server overhead at concurrency 1: p50 of one /v1/embeddings round trip over loopback HTTP,
   less p50 of the same work called directly (TextEncoder + Runner, in process). Target <= 2 ms.
2. Dynamic batching at concurrency 32: requests/s with --max-batch-size 32 over requests/s with
   --max-batch-size 1, same server, same clients. Target >= 3x.

Timings on shared machines vary run to run, so both figures are ratios or differences measured in
the same run, after warm-up, as medians over rounds that alternate the variants.

    .venv/bin/python benchmarks/serve_bench.py ARTIFACT [--rounds 3] [--seconds 8]
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = "The quick brown fox jumps over the lazy dog."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(artifact: Path, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve", str(artifact), "--port", str(port),
                             "--log-level", "warning", *args], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not ready(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not start (exit {proc.poll()})")
        time.sleep(0.2)
    return proc, port


def ready(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


def model_name(artifact: Path) -> str:
    from serve.app import default_model_name
    from engines.artifact import read_manifest

    return default_model_name(artifact, read_manifest(artifact))


def post(conn: http.client.HTTPConnection, body: bytes) -> None:
    conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {payload[:200]!r}")


def p50_ms(call, n: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def direct_p50(artifact: Path, threads: int, n: int) -> float:
    """The same work the server does for one text (tokenize, run, read the embedding), called
    directly: the faster of the pipeline's Runner (engines.load, spinning threads) and the
    serving Runner (sleeping threads), so the overhead is measured against the best direct call."""
    import engines
    from engines.artifact import read_manifest
    from engines import load_engine
    from engines.text import TextEncoder

    engine = read_manifest(artifact)["engine"]
    text = TextEncoder(artifact / engine.get("tokenizer", "tokenizer"), int(engine.get("max_length", 128)))
    best = float("inf")
    for make in (lambda: engines.load(artifact, threads=threads),
                 lambda: load_engine(artifact, engine, threads=threads, spinning=False)):
        runner = make()
        best = min(best, p50_ms(lambda: runner(text([TEXT]))["sentence_embedding"], n, warmup=20))
        del runner
    return best


def server_p50(port: int, body: bytes, n: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    return p50_ms(lambda: post(conn, body), n, warmup=20)


def throughput(port: int, body: bytes, clients: int, seconds: float, warmup_s: float = 2.0) -> float:
    """Requests/s with `clients` closed-loop clients, counted after a warm-up period."""
    stop, counting, counts, errors = threading.Event(), threading.Event(), [0] * clients, []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            try:
                post(conn, body)
            except Exception as exc:  # counted, and reported below
                errors.append(exc)
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                continue
            if counting.is_set():
                counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    counting.set()
    start = time.perf_counter()
    time.sleep(seconds)
    done = sum(counts)
    elapsed = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join(60)
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="per latency round")
    parser.add_argument("--seconds", type=float, default=8.0, help="per throughput round")
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    from serve.config import ServeConfig

    threads = ServeConfig().ort_threads()
    body = json.dumps({"model": model_name(args.artifact), "input": TEXT}).encode()
    direct, served, batched, single = [], [], [], []
    for round_ in range(args.rounds):
        proc, port = start_server(args.artifact)
        try:
            served.append(server_p50(port, body, args.requests))
            direct.append(direct_p50(args.artifact, threads, args.requests))
            batched.append(throughput(port, body, args.clients, args.seconds))
        finally:
            stop_server(proc)
        proc, port = start_server(args.artifact, "--max-batch-size", "1")
        try:
            single.append(throughput(port, body, args.clients, args.seconds))
        finally:
            stop_server(proc)
        print(f"round {round_ + 1}: direct p50 {direct[-1]:.2f} ms, served p50 {served[-1]:.2f} ms, "
              f"batched {batched[-1]:.1f} req/s, batch-size-1 {single[-1]:.1f} req/s", flush=True)
    result = {
        "direct_p50_ms": statistics.median(direct), "served_p50_ms": statistics.median(served),
        "overhead_p50_ms": statistics.median([s - d for s, d in zip(served, direct)]),
        "batched_req_per_s": statistics.median(batched), "batch1_req_per_s": statistics.median(single),
        "batching_speedup": statistics.median([b / s for b, s in zip(batched, single)]),
        "clients": args.clients, "rounds": args.rounds, "ort_threads": threads,
    }
    print(json.dumps(result, indent=2))
    print(f"overhead at concurrency 1: {result['overhead_p50_ms']:.2f} ms (target <= 2 ms): "
          f"{'met' if result['overhead_p50_ms'] <= 2 else 'NOT met'}")
    print(f"dynamic batching at concurrency {args.clients}: {result['batching_speedup']:.2f}x (target >= 3x): "
          f"{'met' if result['batching_speedup'] >= 3 else 'NOT met'}")


if __name__ == "__main__":
    main()
