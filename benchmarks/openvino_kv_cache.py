"""An OpenVINO GenAI artifact's KV cache at each precision: perplexity on held-out text scored through
that cache (engines/openvino/genai_runner.py reads a quantized cache back, as generation does), and
what a GiB holds (bytes a token, tokens, concurrent sequences of a shape), from the engine's own
block layout (engines/openvino/genai_batch.py, checked against the pipeline's allocation in
tests/engines/test_openvino_genai_kv.py).

    .venv/bin/python -m benchmarks.openvino_kv_cache ARTIFACT \
        [--precisions f32 u8 u4 u4:32] [--tokens 2048] [--window 512] [--sequence-tokens 1024]

A precision is written KIND or KIND:GROUP (u4:32: values in groups of 32 channels). The artifact's
weights and inference precision are kept; only the KV cache changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.artifact_input import artifact_manifest, refuse, refuse_unwritable
from serve import arguments as cli

GIB = 2**30


def held_out_ids(folder: Path, tokens: int) -> list[int]:
    """The held-out CPython docs the gate's perplexity reads, in the artifact's own tokens."""
    from tokenizers import Tokenizer

    import calibration

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = calibration.load("cpython_docs", "evaluation", 100, 1).items
    ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False).ids[:tokens]
    if len(ids) < tokens:
        refuse(f"the held-out text has {len(ids)} tokens; --tokens {tokens} asked")
    return ids


def capacity(config: dict, kind: str, group: int, sequence_tokens: int) -> dict:
    from engines.openvino.genai_batch import CPU_KV_BLOCK_TOKENS, kv_block_bytes

    block = kv_block_bytes(config, kind, group)
    blocks = GIB // block
    per_sequence = -(-(sequence_tokens + 1) // CPU_KV_BLOCK_TOKENS)
    return {
        "bytes_per_token": block / CPU_KV_BLOCK_TOKENS,
        "tokens_per_gib": blocks * CPU_KV_BLOCK_TOKENS,
        "sequences_per_gib": blocks // per_sequence,
    }


def measure(folder: Path, engine: dict, spec: str, ids: list[int], window: int, sequence_tokens: int) -> dict:
    from engines.openvino.genai_runner import OVGenAIRunner
    from optimize.evaluate.generation import perplexity

    kind, _, group_text = spec.partition(":")
    group = int(group_text or 0)
    inference = engine.get("inference_precision", "f32")
    runner = OVGenAIRunner(
        folder, inference_precision=inference, kv_cache_precision=kind, kv_cache_group_size=group, threads=0
    )
    config = json.loads((folder / "config.json").read_text())
    held = capacity(config, kind, group, sequence_tokens)
    return {"kv_cache": spec, "perplexity": perplexity(runner, ids, window), **held}


def markdown(rows: list[dict], sequence_tokens: int, machine: str) -> str:
    base = rows[0]
    lines = [
        f"Machine: {machine}. Perplexity over the held-out tokens, scored through each KV cache; "
        f"capacity per GiB of --kv-cache-gb (sequences of {sequence_tokens} tokens).",
        "",
        "| KV cache | perplexity | vs first | bytes/token | tokens/GiB | sequences/GiB | vs first |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kv_cache']} | {r['perplexity']:.3f} | {(r['perplexity'] / base['perplexity'] - 1) * 100:+.2f}% | "
            f"{r['bytes_per_token']:,.0f} | {r['tokens_per_gib']:,} | {r['sequences_per_gib']:,} | "
            f"{r['sequences_per_gib'] / max(1, base['sequences_per_gib']):.2f}x |"
        )
    return "\n".join(lines)


def kv_precision(text: str) -> str:
    """An argparse type: KIND or KIND:GROUP, KIND one the engine takes, GROUP a whole number from 1."""
    from engines.openvino.genai_runner import KV_CACHE_PRECISIONS

    kind, colon, group = text.partition(":")
    if kind not in KV_CACHE_PRECISIONS:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: the kind is one of {', '.join(KV_CACHE_PRECISIONS)}")
    if colon:
        cli.count(4096)(group)
    return text


def main(argv=None) -> list[dict]:
    p = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--precisions", type=kv_precision, nargs="+", default=["f32", "u8", "u4", "u4:32"])
    p.add_argument("--tokens", type=cli.count(1 << 20, low=2), default=2048)
    p.add_argument("--window", type=cli.count(1 << 17, low=2), default=512)
    p.add_argument("--sequence-tokens", type=cli.count(1 << 20), default=1024)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    refuse_unwritable(args.json)
    engine = artifact_manifest(args.artifact).get("engine") or {}
    if engine.get("format") != "openvino-genai":
        refuse(f"{args.artifact} is not an OpenVINO GenAI artifact (engine format {engine.get('format')})")
    folder = args.artifact / engine.get("dir", ".")
    ids = held_out_ids(folder, args.tokens)
    try:
        rows = [measure(folder, engine, s, ids, args.window, args.sequence_tokens) for s in args.precisions]
    except (ValueError, RuntimeError) as exc:  # a precision or group size the plugin refuses
        refuse(str(exc).strip().splitlines()[-1])
    from benchmarks.serve_prompt_lookup import machine

    print(markdown(rows, args.sequence_tokens, machine()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
