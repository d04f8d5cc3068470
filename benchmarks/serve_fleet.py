"""The fleet targets (docs/deploy.md), measured on this machine with the encoder artifact:

1. `ray`: two Ray Serve replicas (`python -m serve.ray --replicas 2`, half the threads each) against
   one `python -m serve` process with the same total threads, at 64 closed-loop clients on
   /v1/embeddings: requests/s of each, failed requests (target: none), and the ratio (target >= 0.9).
2. `shadow`: `python -m serve ARTIFACT` with and without `--shadow CANDIDATE` (default: the same
   artifact), at 16 clients: p50 latency of each and the ratio (target <= 1.05), with what the
   shadow compared and dropped.

3. `agreement`: the artifact shadowed by CANDIDATE, fed the texts the gate evaluated (drawn again
   from the manifest's evaluation source, split, count and seed, checked against its sha256), in
   the gate's batches: the shadow report's cosine min and mean beside the gate's (target: equal within
   numerics when the candidate computes what the gate's baseline does, e.g. the FP32 export).

Variants alternate A-B-B-A over `--rounds`, so a change in the machine's other load falls on both;
the medians are reported. The clients run on one asyncio event loop in this process (keep-alive
connections, each sends its next request when its answer arrives).

    .venv/bin/python -m benchmarks.serve_fleet ARTIFACT ray [--rounds 2] [--seconds 15] [--ingress proxy haproxy]
    .venv/bin/python -m benchmarks.serve_fleet ARTIFACT shadow [--candidate OTHER] [--rounds 3]
    .venv/bin/python -m benchmarks.serve_fleet ARTIFACT agreement --candidate FP32_ARTIFACT
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # so that python benchmarks/serve_fleet.py runs as python -m benchmarks.serve_fleet does

from benchmarks.artifact_input import artifact_manifest  # noqa: E402 (after the path)
from serve import arguments as cli  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog."


def free_port() -> int:
    from serve.shadow.candidate import free_port as pick

    return pick()


def start(command: list[str], port: int, timeout_s: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, *command, "--port", str(port), "--log-level", "warning"], cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(command[:2])} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            key, value = line.split(b":", 1)
            headers[key.strip().lower()] = value.strip()
    if b"content-length" in headers:
        await reader.readexactly(int(headers[b"content-length"]))
    else:  # chunked (a proxy may re-chunk the answer)
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            await reader.readexactly(size + 2)
        await reader.readuntil(b"\r\n")
    return status


async def load(port: int, body: bytes, clients: int, seconds: float, warmup_s: float = 3.0) -> dict:
    request = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    state: dict = {"counting": False, "stop": False, "latency": [], "errors": 0, "first_error": None, "reconnects": 0}

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not state["stop"]:
                started = time.perf_counter()
                writer.write(request)
                try:
                    status = await read_response(reader)
                except asyncio.IncompleteReadError as closed:
                    if closed.partial:
                        raise
                    # The server closed this keep-alive connection before answering (a proxy that
                    # reloads does): reconnect and send again, as an HTTP client's pool does.
                    state["reconnects"] += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    continue
                if status != 200:
                    state["errors"] += 1
                    state["first_error"] = state["first_error"] or status
                elif state["counting"]:
                    state["latency"].append(time.perf_counter() - started)
        finally:
            writer.close()

    tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    await asyncio.sleep(warmup_s)
    state["counting"], start_at = True, time.perf_counter()
    await asyncio.sleep(seconds)
    state["counting"], elapsed = False, time.perf_counter() - start_at
    state["stop"] = True
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    latency = sorted(state["latency"])
    return {
        "req_per_s": len(latency) / elapsed,
        "p50_ms": 1e3 * statistics.median(latency) if latency else None,
        "errors": state["errors"] + len(failures),
        "first_error": state["first_error"] or (repr(failures[0]) if failures else None),
        "reconnects": state["reconnects"],
    }


def wait_for_shadow(port: int, body: bytes, timeout_s: float = 300) -> None:
    """Until the candidate has compared one request: the shadowed variant is timed with it working."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/embeddings", body, {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=30).read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            if 'serve_shadow_requests_total{outcome="compared"}' in response.read().decode():
                return
        time.sleep(0.5)
    raise SystemExit("the shadow candidate compared nothing")


def measure(command: list[str], body: bytes, clients: int, seconds: float) -> dict:
    port = free_port()
    proc = start(command, port)
    try:
        if "--shadow" in command:
            wait_for_shadow(port, body)
        return asyncio.run(load(port, body, clients, seconds))
    finally:
        stop(proc)


def body_for(artifact: Path) -> bytes:
    from engines.artifact import read_manifest
    from serve.app import default_model_name

    return json.dumps({"model": default_model_name(artifact, read_manifest(artifact)), "input": TEXT}).encode()


def alternate(variants: dict[str, list[str]], body: bytes, clients: int, seconds: float, rounds: int) -> dict:
    names = list(variants)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            result = measure(variants[name], body, clients, seconds)
            print(f"round {r + 1}: {name}: {json.dumps(result)}", flush=True)
            results[name].append(result)
    return results


def median_of(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results if r[key] is not None)


def evaluated_texts(artifact: Path) -> list[str]:
    """The texts the gate evaluated, drawn again as the pipeline drew them, checked by their hash."""
    import calibration
    from engines.artifact import read_manifest

    drawn = read_manifest(artifact)["evaluation"]
    texts = calibration.load(drawn["source"], drawn["split"], drawn["count"], drawn["seed"])
    if texts.sha256 != drawn["sha256"]:
        raise SystemExit(f"{artifact}: the evaluation texts drawn again differ from the gate's (sha256)")
    return list(texts.items)


def agreement(artifact: Path, candidate: Path) -> None:
    from engines.artifact import read_manifest
    from optimize.evaluate.harness import FIDELITY_BATCH

    texts, report, port = evaluated_texts(artifact), tempfile.mkdtemp(prefix="shadow-report-"), free_port()
    model = json.loads(body_for(artifact))["model"]
    command = ["-m", "serve", str(artifact), "--shadow", str(candidate), "--shadow-report", report]
    proc = start([*command, "--shadow-queue", str(len(texts) + 1)], port)
    try:
        # In the gate's batches (FIDELITY_BATCH texts, padded together): an engine that quantizes
        # activations per batch answers a text differently alone than beside others.
        batches = [texts[i : i + FIDELITY_BATCH] for i in range(0, len(texts), FIDELITY_BATCH)]
        bodies = [json.dumps({"model": model, "input": batch}).encode() for batch in batches]
        wait_for_shadow(port, bodies[0])  # warmed on evaluated texts: every row compared is one
        for body in bodies[1:]:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/embeddings", body, {"Content-Type": "application/json"}
            )
            urllib.request.urlopen(request, timeout=60).read()
        time.sleep(5)  # the last comparisons finish off the response path
    finally:
        stop(proc)  # writes the report on shutdown
    shadow = json.loads((Path(report) / "shadow.json").read_text())
    gate = read_manifest(artifact)["metrics"]["candidate"]["fidelity"]
    print(f"agreement: shadow {json.dumps(shadow['figures'])}, requests {shadow['requests']}")
    cosines = f"cosine_min {gate['cosine_min']:.6f} cosine_mean {gate['cosine_mean']:.6f}"
    print(f"agreement: gate {cosines} ({gate['samples']} samples)")


def parse_args(argv=None):
    """The command line, every value checked before any server starts (one line, exit 2)."""
    parser = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("target", choices=["ray", "shadow", "agreement"])
    parser.add_argument("--rounds", type=cli.count(1000), default=2)
    parser.add_argument("--seconds", type=cli.seconds(3600), default=15.0)
    parser.add_argument(
        "--threads", type=cli.count(1024), default=2, help="total ONNX Runtime threads of the artifact's side"
    )
    parser.add_argument("--clients", type=cli.count(4096), help="default 64 (ray), 16 (shadow)")
    parser.add_argument(
        "--ingress", nargs="+", default=["proxy", "haproxy"], choices=["proxy", "haproxy"], help="ray: the ingresses"
    )
    parser.add_argument("--candidate", type=Path, help="shadow: the candidate (default: the artifact itself)")
    args = parser.parse_args(argv)
    artifact_manifest(args.artifact)
    if args.candidate is not None:
        if args.target == "ray":
            parser.error("--candidate is for the shadow and agreement targets, not ray")
        artifact_manifest(args.candidate)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    body, art, threads = body_for(args.artifact), str(args.artifact), args.threads
    if args.target == "ray":
        half = max(1, threads // 2)
        replicas = ["-m", "serve.ray", art, "--replicas", "2", "--threads", str(half), "--cpus-per-replica", str(half)]
        variants = {"one process": ["-m", "serve", art, "--threads", str(threads)]}
        variants.update({f"ray 2 replicas, {ingress}": [*replicas, "--ingress", ingress] for ingress in args.ingress})
        results = alternate(variants, body, args.clients or 64, args.seconds, args.rounds)
        one = median_of(results["one process"], "req_per_s")
        for name in list(variants)[1:]:
            ray = median_of(results[name], "req_per_s")
            errors = sum(r["errors"] for r in results[name])
            print(f"{name}: {ray:.1f} req/s against one process's {one:.1f}, ratio {ray / one:.2f} (target >= 0.9)")
            print(f"{name}: failed requests {errors} (target 0)")
        return
    if args.target == "agreement":
        return agreement(args.artifact, args.candidate or args.artifact)
    report = tempfile.mkdtemp(prefix="shadow-report-")
    candidate = str(args.candidate or args.artifact)
    variants = {
        "alone": ["-m", "serve", art, "--threads", str(threads)],
        "shadowed": ["-m", "serve", art, "--threads", str(threads), "--shadow", candidate, "--shadow-report", report],
    }
    results = alternate(variants, body, args.clients or 16, args.seconds, args.rounds)
    alone, shadowed = (median_of(results[n], "p50_ms") for n in variants)
    print(
        f"shadow: p50 alone {alone:.1f} ms, shadowed {shadowed:.1f} ms, ratio {shadowed / alone:.3f} (target <= 1.05)"
    )
    summary = json.loads((Path(report) / "shadow.json").read_text())
    print(f"shadow: last round's report: {json.dumps(summary['figures'])}, requests {summary['requests']}")


if __name__ == "__main__":
    main()
