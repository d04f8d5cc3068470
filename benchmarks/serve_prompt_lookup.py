"""Prompt lookup against the plain engine on input-grounded requests (optimize/evaluate/grounded.py:
edit or summarise a given paragraph), through `python -m serve` on loopback: aggregate output
tokens/s and TTFT p95 at each client count, with and without `--prompt-lookup`, the accepted tokens
per step from the server's /metrics, and whether the greedy texts are the same.

    .venv/bin/python -m benchmarks.serve_prompt_lookup ARTIFACT \
        [--clients 1 16] [--prompt-tokens 256] [--new-tokens 128] [--per-client 4] [--json OUT]

ARTIFACT is an OpenVINO GenAI causal-LM artifact (continuous batching). Both servers run with
--max-num-seqs the largest client count; every request is greedy (temperature 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks.artifact_input import artifact_manifest, artifact_tokenizer, refuse, refuse_unwritable
from optimize.evaluate.grounded import grounded_requests
from optimize.evaluate.served import ServedServer, drive, one_request
from serve import arguments as cli

MODES = {"plain": "--no-prompt-lookup", "prompt lookup": "--prompt-lookup"}
SPEC_METRICS = ("serve_spec_decode_num_drafts_total", "serve_spec_decode_num_accepted_tokens_total")


def machine() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    model = names[0] if names else platform.processor() or platform.machine()
    return f"{model}, {len(os.sched_getaffinity(0))} cores available"


def spec_counts(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in SPEC_METRICS}


def prompt_ids(url: str, model: str, requests: list[list[dict]]) -> list[list[int]]:
    """Each chat request as the server's own chat template renders it, in token ids."""
    import httpx

    return [
        httpx.post(url + "/tokenize", json={"model": model, "messages": m}, timeout=30).json()["tokens"]
        for m in requests
    ]


def greedy_texts(url: str, model: str, prompts, new_tokens: int) -> list[str]:
    import httpx

    async def each():
        async with httpx.AsyncClient(timeout=300) as client:
            return [(await one_request(client, url, model, p, new_tokens)).text for p in prompts]

    return asyncio.run(each())


def measure(artifact: Path, flag: str, args, messages) -> dict:
    command = [sys.executable, "-m", "serve", str(artifact), "--port", "0", "--allow-failed-gate"]
    command += ["--max-num-seqs", str(max(args.clients)), "--max-tokens", str(args.new_tokens), flag]
    server = ServedServer(flag, command, "/v2/health/ready")
    try:
        server.wait_ready()
        import httpx

        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        prompts = prompt_ids(server.url, model, messages)
        texts = greedy_texts(server.url, model, prompts[:4], args.new_tokens)  # also the warm-up
        levels = []
        for clients in args.clients:
            before = spec_counts(server.url)
            row = drive(server.url, model, prompts, clients, args.per_client, args.new_tokens)
            after = spec_counts(server.url)
            steps = after.get(SPEC_METRICS[0], 0) - before.get(SPEC_METRICS[0], 0)
            accepted = after.get(SPEC_METRICS[1], 0) - before.get(SPEC_METRICS[1], 0)
            row["tokens_per_step"] = round(1 + accepted / steps, 2) if steps else None
            levels.append(row)
        return {"levels": levels, "texts": texts, "prompt_tokens": sum(map(len, prompts)) // len(prompts)}
    finally:
        server.stop()


def markdown(report: dict) -> str:
    plain, lookup = report["plain"]["levels"], report["prompt lookup"]["levels"]
    lines = [
        f"Machine: {report['machine']}. {report['requests']} grounded requests (edit / summarise a paragraph), "
        f"prompts {report['plain']['prompt_tokens']} tokens on average, {report['new_tokens']} new tokens, greedy; "
        f"greedy texts identical: {report['identical']}.",
        "",
        "| clients | plain tok/s | prompt lookup tok/s | speedup | tokens per step | TTFT p95 ms plain / lookup |",
        "|---|---|---|---|---|---|",
    ]
    for a, b in zip(plain, lookup):
        speedup = b["tokens_per_s"] / a["tokens_per_s"] if a["tokens_per_s"] and b["tokens_per_s"] else None
        lines.append(
            f"| {a['clients']} | {a['tokens_per_s']} | {b['tokens_per_s']} | "
            f"{'-' if speedup is None else f'{speedup:.2f}x'} | {b['tokens_per_step']} | "
            f"{a['ttft_p95_ms']} / {b['ttft_p95_ms']} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--clients", type=cli.count(1024), nargs="+", default=[1, 16])
    p.add_argument(
        "--prompt-tokens", type=cli.count(1 << 17, low=8), default=256, help="tokens of each paragraph (default 256)"
    )
    p.add_argument("--new-tokens", type=cli.count(1 << 17), default=128)
    p.add_argument(
        "--per-client", type=cli.count(10_000), default=4, help="requests each client sends in turn (default 4)"
    )
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = p.parse_args(argv)
    refuse_unwritable(args.json)
    artifact_manifest(args.artifact, serves="causal_lm")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    tokenize, decode = artifact_tokenizer(args.artifact)
    count = max(max(args.clients) * args.per_client, 4)
    try:
        messages = grounded_requests(count, args.prompt_tokens, tokenize, decode)
    except ValueError as exc:
        refuse(str(exc))
    report: dict = {"machine": machine(), "requests": count, "new_tokens": args.new_tokens}
    for name, flag in MODES.items():
        report[name] = measure(args.artifact, flag, args, messages)
    report["identical"] = report["plain"]["texts"] == report["prompt lookup"]["texts"]
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
