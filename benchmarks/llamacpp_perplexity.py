"""llama.cpp's perplexity on the GGUF file an artifact's recipe starts from, on the artifact's own
held-out tokens, beside the artifact's and its baseline's.

    .venv/bin/python -m benchmarks.llamacpp_perplexity ARTIFACT [--llama-cpp DIR] [--threads 2] [--json OUT]

A GGUF source's baseline is the file dequantized to FP32 and run in PyTorch; llama.cpp runs the file
as it is, with its own kernels (which quantize activations to 8 bits for the 4- and 8-bit weight
types). This tells how far llama.cpp's run of the user's file is from that baseline, on exactly the
tokens and windows the pipeline scored (the recipe's evaluation text rebuilt, tokenized by the
artifact's tokenizer and checked against the sha256 the manifest recorded).

llama-server returns no log-probabilities of a prompt, and llama-perplexity scores the second half of
each window after a BOS, so the figure comes from a small C program (benchmarks/llamacpp_score.c)
compiled against a llama.cpp build: its source tree with `include/llama.h` and `ggml/include`, and
`libllama.so` in `build/bin` (a `BUILD_SHARED_LIBS` build, llama.cpp's default). The tree is
`--llama-cpp DIR`, else $PEERS_LLAMA_CPP, else the tree the llama-server found as the served load's
benchmark finds it lives in. The program is compiled once per build into the pipeline's cache.

llama.cpp repacks weights for its CPU kernels by default; where a signal kills it on a window (its
AMX kernels on some Intel Xeons fault on batches of two rows or more), it scores again with one row
a batch, then without repacking, and says which ran. Bad input (no artifact, no GGUF, no llama.cpp
tree, no C compiler) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks import figure_record
from benchmarks.artifact_input import artifact_manifest, refuse, refuse_unwritable
from serve.arguments import OneLineParser

SCORER_SOURCE = Path(__file__).with_name("llamacpp_score.c")


class ScorerCrash(RuntimeError):
    """A signal killed the scorer (a kernel fault, not a wrong input)."""


class ScorerRefused(RuntimeError):
    """The scorer refused its input: ids outside the vocabulary, or a model llama.cpp does not load."""


REFUSED_EXITS = (2, 3)  # llamacpp_score.c: bad ids or arguments, a model or context that did not load


def llama_tree(given: str | None) -> Path:
    """The llama.cpp source tree with a shared-library build: --llama-cpp, $PEERS_LLAMA_CPP, or the one
    the llama-server found lives in (build/bin/llama-server); refused in one line otherwise."""
    from benchmarks import llamacpp

    value = given or os.environ.get("PEERS_LLAMA_CPP")
    if value:
        tree = Path(value).expanduser()
    else:
        server, why = llamacpp.find_tool(None, "PEERS_LLAMA_SERVER", "llama-server", "--llama-server")
        if server is None:
            refuse(f"no llama.cpp build found (give --llama-cpp DIR, set $PEERS_LLAMA_CPP, or: {why})")
        tree = server.resolve().parents[2]
    needed = ("include/llama.h", "ggml/include/ggml.h", "build/bin/libllama.so")
    missing = [path for path in needed if not (tree / path).is_file()]
    if missing:
        refuse(f"{tree}: not a llama.cpp source tree with a shared-library build (no {', '.join(missing)})")
    return tree


def compiled_scorer(tree: Path) -> Path:
    """The scorer built against `tree`'s llama.cpp, compiled once per source and library into the cache."""
    from optimize.sources.models import cache_root

    library = tree / "build" / "bin"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        refuse("no C compiler found to build benchmarks/llamacpp_score.c (install gcc, or set $CC)")
    key = hashlib.sha256(SCORER_SOURCE.read_bytes() + str(library.resolve()).encode())
    key.update(str((library / "libllama.so").stat().st_mtime_ns).encode())
    binary = cache_root() / "llamacpp-score" / key.hexdigest()[:16] / "llamacpp_score"
    if binary.is_file():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(".partial")
    command = [compiler, "-O2", "-o", str(partial), str(SCORER_SOURCE), f"-I{tree / 'include'}",
               f"-I{tree / 'ggml' / 'include'}", f"-L{library}", "-lllama", "-lm", f"-Wl,-rpath,{library}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        refuse(f"compiling {SCORER_SOURCE.name} against {tree} failed: {said[:200]}")
    partial.replace(binary)  # whole or not at all: a cut compile leaves no binary to reuse
    return binary


def score(scorer: Path, gguf: Path, ids: list[int], window: int, threads: int, repack: bool, ubatch: int) -> dict:
    """{"nll", "tokens", "vocab", "per_token"} from one run of the scorer; ScorerCrash where a signal killed it,
    RuntimeError (one line) where it failed otherwise."""
    from optimize.evaluate.served import exit_status

    command = [str(scorer), str(gguf), str(window), str(threads), str(int(repack)), str(ubatch)]
    done = subprocess.run(command, input=" ".join(map(str, ids)), capture_output=True, text=True)
    if done.returncode < 0:
        raise ScorerCrash(exit_status(done.returncode))
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        failed = ScorerRefused if done.returncode in REFUSED_EXITS else RuntimeError
        raise failed(f"llama.cpp's scorer exited with {done.returncode} on {gguf.name}: {said[:200]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


FILE_LAYOUT = "weights as in the file"


def configurations(window: int, repack: bool = True) -> dict[str, tuple[bool, int]]:
    """What llama.cpp is scored with, in the order tried, as (repack, rows a batch): as it runs by
    default, one row a batch with its weights still repacked, and the file's own layout (alone where
    not `repack`)."""
    tried = {
        "repacked weights": (True, window),
        "repacked weights, one row a batch": (True, 1),
        FILE_LAYOUT: (False, window),
    }
    return tried if repack else {FILE_LAYOUT: tried[FILE_LAYOUT]}


def measure(scorer: Path, gguf: Path, ids: list[int], window: int, threads: int, repack: bool = True) -> dict:
    """llama.cpp's perplexity on `ids` (and each scored token's negative log-likelihood), with the
    first of `configurations` no signal kills, and notes on the ones that died."""
    notes = []
    for name, (repacked, ubatch) in configurations(window, repack).items():
        try:
            result = score(scorer, gguf, ids, window, threads, repacked, ubatch)
        except ScorerCrash as crash:
            notes.append(f"with {name} it died with {crash}")
            continue
        perplexity = math.exp(result["nll"] / result["tokens"])
        return {"perplexity": perplexity, "tokens": result["tokens"], "ran_with": name, "notes": notes,
                "per_token": result["per_token"]}  # fmt: skip
    raise RuntimeError("llama.cpp's scorer died in every configuration: " + "; ".join(notes))


def recorded(manifest: dict, side: str) -> float | None:
    value = ((manifest.get("metrics") or {}).get(side) or {}).get("perplexity")
    return float(value) if isinstance(value, (int, float)) else None


def report(artifact: Path, args: argparse.Namespace) -> dict:
    from benchmarks import llamacpp
    from optimize.errors import RecipeError
    from optimize.export.vllm import perplexity_ids
    from optimize.sources.gguf_header import read_header

    manifest = artifact_manifest(artifact)
    gguf, why = (args.gguf, "") if args.gguf else llamacpp.recipe_gguf(manifest)
    if gguf is None or not gguf.is_file():
        refuse(why or f"--gguf {gguf}: no such file")
    try:
        read_header(gguf)  # a bounded read of its header: not a GGUF is one line here, not llama.cpp's log
    except RecipeError as exc:
        refuse(f"{gguf}: {exc}")
    try:
        ids, window = perplexity_ids(artifact, manifest)
    except RecipeError as exc:
        refuse(str(exc))
    scorer = compiled_scorer(llama_tree(args.llama_cpp))
    result = measure(scorer, gguf, ids, window, args.threads, repack=not args.no_repack)
    del result["per_token"]  # the figure is the perplexity; tests read the tokens' own
    baseline, candidate = recorded(manifest, "baseline"), recorded(manifest, "candidate")
    result.update(gguf=gguf.name, window=window, baseline_perplexity=baseline, artifact_perplexity=candidate)
    if baseline:
        result["increase_over_baseline_pct"] = 100 * (result["perplexity"] / baseline - 1)
        if candidate:
            result["artifact_increase_over_baseline_pct"] = 100 * (candidate / baseline - 1)
    return result


def summary(result: dict) -> str:
    lines = [f"llama.cpp on {result['gguf']} ({result['ran_with']}): perplexity {result['perplexity']:.4f} "
             f"over {result['tokens']} tokens in windows of {result['window']}"]  # fmt: skip
    if "increase_over_baseline_pct" in result:
        lines.append(
            f"  {result['increase_over_baseline_pct']:+.2f}% over the baseline's {result['baseline_perplexity']:.4f}"
        )
    if "artifact_increase_over_baseline_pct" in result:
        increase = result["artifact_increase_over_baseline_pct"]
        lines.append(f"  the artifact: {result['artifact_perplexity']:.4f}, {increase:+.2f}%")
    return "\n".join([*(f"note: {n}" for n in result["notes"]), *lines])


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--llama-cpp", help="llama.cpp's source tree with a build (else $PEERS_LLAMA_CPP or llama-server's)")
    p.add_argument("--gguf", type=Path, help="the GGUF file to score (default: the recipe's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-repack", action="store_true", help="score with the file's layout (llama.cpp's plain kernels)")
    p.add_argument("--json", type=Path)
    figure_record.add_option(p)
    args = p.parse_args(argv)
    refuse_unwritable(args.json, args.record)
    if not 1 <= args.threads <= 1024:
        refuse(f"--threads {args.threads}: from 1 to 1024")
    try:
        result = report(args.artifact, args)
    except ScorerRefused as exc:
        refuse(str(exc))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(summary(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.record and "artifact_increase_over_baseline_pct" not in result:
        print("error: no record written: the manifest records no baseline and artifact perplexity", file=sys.stderr)
        raise SystemExit(1)
    if args.record:
        fields = record_fields(artifact_manifest(args.artifact), result)
        figure_record.write(args, "benchmarks.llamacpp_perplexity", argv, **fields)
    return result


def record_fields(manifest: dict, result: dict) -> dict:
    """The row of docs/figures.md's table this run measures: the artifact's perplexity over its baseline
    beside llama.cpp's own run of the same file, on the same held-out tokens."""
    return {
        "measure": f"The {manifest['engine'].get('format')} artifact of {manifest['recipe']['name']}: perplexity "
        f"on {result['tokens']} held-out tokens, over the baseline's {result['baseline_perplexity']:.4f}",
        "figure": f"{result['artifact_perplexity']:.4f} ({result['artifact_increase_over_baseline_pct']:+.4f}%)",
        "ratio": f"llama.cpp on the same file ({Path(result['gguf']).name}, {result['ran_with']}): "
        f"{result['perplexity']:.4f} ({result['increase_over_baseline_pct']:+.2f}%)",
    }


if __name__ == "__main__":
    main()
