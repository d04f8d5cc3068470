"""llama.cpp's own programs as peers, and where the benchmarks find a peer's program.

    .venv/bin/python -m benchmarks.llamacpp ARTIFACT_OR_GGUF [--llama-bench PATH] [--threads 2] [--tokens 64]

prints llama-bench's decode reference (tg64: 64 tokens generated after an empty prompt, `--threads`
threads, its mean tokens/s over --repetitions) on the GGUF file an artifact's recipe starts from (or
the GGUF given). benchmarks/serve_llm_load.py runs `llama-server` on the same file.

    .venv/bin/python -m benchmarks.llamacpp ARTIFACT --rounds 5 [--runs 5] [--threads 2] [--tokens 64]

compares the artifact's own decode with it, in turns: each round runs llama-bench for --runs
repetitions (the median of its per-repetition figures) and times the artifact's greedy decode
(`--tokens` new tokens after a 64-token held-out prompt, the median of --runs generations, in a worker
process of its own as the pipeline times its candidates), the order reversed every other round; it
prints each round's pair and ratio and the medians. On a shared machine either engine's speed moves
with the half hour (llama-bench read 112 to 158 tok/s on one 2-core machine in one day), so figures
taken one after the other measure the hour as much as the engines.

Either way llama-bench first reads an 8-token prompt. Its tg test has no prompt, and on some machines
llama.cpp's repacked weights decode from an empty prompt yet die on a prompt read in one batch (an
Intel Xeon VM with AMX: SIGILL in its AMX kernel on any batch of two rows or more). Where a signal kills
it there, it is timed with the first flags that read the prompt: `-ub 1` (one token a batch, the
repacked weights kept: the llama.cpp that serves one sequence there), else `--repack 0`; the output
says which and why.

A peer's program is found by its flag, else its environment variable, else on PATH, never at a path
of one machine: PEERS_LLAMA_SERVER and PEERS_LLAMA_BENCH name llama.cpp's binaries (a build's
build/bin/ holds both). A path given that is not an executable is refused in one line (exit 2); a
program found nowhere is one line saying how to give it, and the benchmark goes on without that peer.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import figure_record
from benchmarks.artifact_input import artifact_manifest, refuse, refuse_unwritable
from serve.arguments import OneLineParser

SLOT_CONTEXT = 1024  # tokens of context per llama-server slot: a 64-token prompt and 64 new tokens fit


def find_tool(given: str | None, env: str, name: str, flag: str) -> tuple[Path | None, str]:
    """The program at `given` (a flag), else at $`env`, else `name` on PATH; (None, why) when none is."""
    for value, source in ((given, flag), (os.environ.get(env), f"${env}")):
        if value:
            path = Path(value).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                refuse(f"{source} {value}: no such executable")
            return path, ""
    found = shutil.which(name)
    if found:
        return Path(found), ""
    return None, f"no {name} found (give {flag} FILE, set ${env}, or put {name} on PATH)"


def version(binary: Path) -> str:
    """`binary --version`'s first line ("version: 7134 (a1b2c3d)"), or '' when it prints none."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0].split(":", 1)[1].strip() if lines else ""


# --- the GGUF a recipe starts from -----------------------------------------------------------------


def source_path(source: str) -> Path:
    from optimize.sources.models import resolve_package_path

    return resolve_package_path(source) if source.startswith("pkg://") else Path(source).expanduser()


def recipe_source(manifest: dict) -> str:
    """The recipe's model.source as the manifest records it; '' where it records none as a string."""
    value: object = manifest
    for key in ("recipe", "resolved", "model", "source"):
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, str) else ""


def recipe_gguf(manifest: dict) -> tuple[Path | None, str]:
    """The GGUF file the artifact's recipe loaded (model.source, pkg:// resolved as the pipeline does),
    or (None, why) when its source is not one."""
    from optimize.errors import RecipeError

    source = recipe_source(manifest)
    if not source.endswith(".gguf"):
        return None, f"the recipe's model.source {source or '(none)'!r} is not a GGUF file (--gguf PATH)"
    try:
        path = source_path(source)
    except RecipeError as exc:
        return None, str(exc)
    if not path.is_file():
        return None, f"model.source={source}: no such file (--gguf PATH)"
    return path, ""


def converted_folder(gguf: Path) -> Path:
    """Where optimize.sources.models.hf_folder keeps the GGUF dequantized to a safetensors folder."""
    from engines.artifact import sha256_file
    from optimize.sources.models import cache_root

    return cache_root() / "gguf" / sha256_file(gguf)[:24]


# --- llama-server ----------------------------------------------------------------------------------


def server_command(
    binary: Path,
    gguf: Path,
    slots: int,
    threads: int,
    port: int | str,
    extra: Sequence[str] = (),
) -> list[str]:
    """llama.cpp's OpenAI-compatible server with `slots` parallel sequences (continuous batching is
    on by default), each with SLOT_CONTEXT tokens of context (-c is shared out over the slots);
    `extra` are the user's own flags (such as --no-repack), last."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(SLOT_CONTEXT * slots), "-t", str(threads), "-tb", str(threads),
            "--jinja", *extra]  # fmt: skip


# --- llama-bench -----------------------------------------------------------------------------------


def bench_command(
    binary: Path,
    gguf: Path,
    threads: int,
    tokens: int,
    repetitions: int,
    extra: Sequence[str] = (),
    prompt: int = 0,
) -> list[str]:
    """tg`tokens` (with the default `-p 0`: no prompt-processing test), JSON out, the user's own flags
    last; with `prompt` tokens and no `tokens`, the pp test alone."""
    return [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(tokens), "-t", str(threads),
            "-r", str(repetitions), "-o", "json", *extra]  # fmt: skip


def run_bench(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """llama-bench's run; RuntimeError (one line) where it outlasts `timeout_s`."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"llama-bench did not finish within {timeout_s:.0f} s: {shlex.join(command)}") from None


def decode_reference(
    binary: Path,
    gguf: Path,
    threads: int = 2,
    tokens: int = 64,
    repetitions: int = 5,
    extra: Sequence[str] = (),
    timeout_s: float = 600,
) -> dict:
    """llama-bench's tg`tokens` on `gguf`: mean, stddev and median tokens/s over its repetitions, and
    the build it measured."""
    command = bench_command(binary, gguf, threads, tokens, repetitions, extra)
    done = run_bench(command, timeout_s)
    if done.returncode != 0:
        from optimize.evaluate.served import exit_status

        tail = " | ".join(done.stderr.strip().splitlines()[-2:])
        raise RuntimeError(f"llama-bench exited with {exit_status(done.returncode)}: {tail}")
    row = tg_row(done.stdout, tokens)
    return {
        "test": f"tg{tokens}",
        "gguf": gguf.name,
        "threads": row.get("n_threads", threads),
        "tokens_per_s": round(float(row["avg_ts"]), 2),
        "stddev_tokens_per_s": round(float(row.get("stddev_ts") or 0.0), 2),
        "median_tokens_per_s": round(median_of(row.get("samples_ts"), default=float(row["avg_ts"])), 2),
        "repetitions": repetitions,
        "build": f"{row.get('build_number', '')} ({row.get('build_commit', '')})",
        "command": command,
    }


# Seen on an Intel Xeon VM with AMX: llama.cpp's repacked weights (its AMX buffer type) run a batch of
# one row through a VNNI kernel, but a batch of two rows or more dies in its AMX kernel (SIGILL at a
# tilezero in tinygemm_kernel_amx). AMX itself runs there: the fault is llama.cpp's. So one sequence
# read one token a batch (-ub 1) keeps the repacked weights and their speed; several sequences at once
# are a batch of several rows whatever -ub says, and need the plain weights.
REPACK_CRASH = (
    "llama.cpp's AMX kernels for repacked weights fault on batches of two rows or more on some CPUs "
    "(seen on an Intel Xeon VM); batches of one row (-ub 1) keep them for one sequence at a time"
)
PROBE_PROMPT_TOKENS = 8
# What keeps llama.cpp alive on a prompt where a signal kills it, in the order tried: one-row batches
# (the repacked weights stay, so does their speed), then the plain weights. Each with the flags by which
# the user's own flags already decide that setting (then it is not tried).
UBATCH_FLAGS = ("-ub", "--ubatch-size")
BENCH_FALLBACKS = ((("-ub", "1"), UBATCH_FLAGS), (("--repack", "0"), ("--repack",)))
SERVER_FALLBACKS = ((("-ub", "1"), UBATCH_FLAGS), (("--no-repack",), ("--no-repack", "-nr", "--repack")))


def fallbacks_left(fallbacks, extra: Sequence[str]) -> list[tuple[str, ...]]:
    """The fallbacks' flags, leaving out those the user's own flags already decide."""
    return [flags for flags, deciding in fallbacks if not set(deciding) & set(extra)]


def prompt_failure(
    binary: Path, gguf: Path, threads: int, extra: Sequence[str], timeout_s: float = 300
) -> tuple[int, str]:
    """llama-bench's exit status on a PROBE_PROMPT_TOKENS-token prompt with these flags, and how it
    ended in words: "-4 (SIGILL)" where a signal killed it, "1 (LAST LINE IT WROTE)" where it failed."""
    from optimize.evaluate.served import exit_status, signal_of

    done = run_bench(bench_command(binary, gguf, threads, 0, 1, extra, prompt=PROBE_PROMPT_TOKENS), timeout_s)
    if done.returncode == 0 or signal_of(done.returncode):
        return done.returncode, exit_status(done.returncode)
    said = (done.stderr.strip().splitlines() or ["nothing on stderr"])[-1]
    return done.returncode, f"{done.returncode} ({said[:200]})"


def serving_flags(binary: Path, gguf: Path, threads: int, extra: Sequence[str]) -> tuple[list[str], str]:
    """llama-bench's flags for a llama.cpp that can answer a request on this machine, and a note where
    they are not the ones given: `extra`, or `extra` and the first of BENCH_FALLBACKS that reads a
    prompt where a signal kills llama-bench on one (its tg test has no prompt, so it would time a
    program no request can use). RuntimeError where no such flags are found."""
    from optimize.evaluate.served import signal_of

    status, failure = prompt_failure(binary, gguf, threads, extra)
    if status == 0:
        return list(extra), ""
    died = " ".join(["llama-bench", *extra]) + f" exited with {failure} on a prompt of {PROBE_PROMPT_TOKENS} tokens"
    if not signal_of(status):
        raise RuntimeError(died)
    tried: list[str] = []
    for fallback in fallbacks_left(BENCH_FALLBACKS, extra):
        status, again = prompt_failure(binary, gguf, threads, [*extra, *fallback])
        if status == 0:
            also = "".join(f", {line}" for line in tried)
            return [*extra, *fallback], (
                f"llama-bench ran with {' '.join(fallback)}: it died with {failure} on a prompt of "
                f"{PROBE_PROMPT_TOKENS} tokens{also}; {REPACK_CRASH}"
            )
        tried.append(f"with {' '.join(fallback)} it exited with {again}")
    raise RuntimeError(", and ".join([died, *tried]))


def median_of(samples, default: float) -> float:
    """The median of llama-bench's per-repetition figures (`samples_ts`), `default` where it gave none."""
    import statistics

    if not isinstance(samples, list) or not samples:
        return default
    return float(statistics.median(float(x) for x in samples))


def tg_row(output: str, tokens: int) -> dict:
    """llama-bench's JSON row of the tg`tokens` test; RuntimeError where its output holds none."""
    try:
        rows = json.loads(output)
        return next(r for r in rows if isinstance(r, dict) and r.get("n_gen") == tokens and "avg_ts" in r)
    except (ValueError, TypeError, StopIteration):
        raise RuntimeError(f"llama-bench printed no tg{tokens} result as JSON: {output.strip()[:120]!r}") from None


def decode_in_turns(
    artifact: Path, binary: Path, gguf: Path, args: argparse.Namespace, flags: Sequence[str], prompt_tokens: int = 64
) -> dict:
    """llama-bench's tg (with `flags`) and the artifact's decode tokens/s, round by round in alternating
    order, and the median of each and of their ratios (the artifact's over llama-bench's)."""
    import statistics

    from benchmarks.peers_lm import artifact_tokens, evaluation_texts
    from engines.artifact import read_manifest
    from engines.runner_process import RunnerProcess
    from optimize.evaluate.generation import prompts_of, speed

    engine = read_manifest(artifact)["engine"]
    prompts = prompts_of(artifact_tokens(artifact, engine), evaluation_texts(), prompt_tokens)
    with RunnerProcess(artifact, engine, threads=args.threads) as runner:
        speed({"artifact": runner}, prompts, args.tokens, 1, 1)  # loads and warms the engine

        def artifact_decode() -> float:
            return speed({"artifact": runner}, prompts, args.tokens, 0, args.runs)["artifact"]["decode_tok_s"]["p50"]

        def bench_decode() -> float:
            reference = decode_reference(binary, gguf, args.threads, args.tokens, args.runs, flags)
            return reference["median_tokens_per_s"]

        rounds = in_turns({"llama_bench": bench_decode, "artifact": artifact_decode}, args.rounds)
    for number, row in enumerate(rounds, start=1):
        row["ratio"] = round(row["artifact"] / row["llama_bench"], 3)
        print(f"round {number}: llama-bench {row['llama_bench']}, artifact {row['artifact']} tok/s: {row['ratio']}x")
    return {
        "rounds": rounds,
        **{f"median_{k}": statistics.median(r[k] for r in rounds) for k in ("llama_bench", "artifact", "ratio")},
    }


def in_turns(measures: dict[str, Callable[[], float]], rounds: int) -> list[dict]:
    """Each round calls every measure once, in the given order on even rounds and reversed on odd ones
    (so neither side always runs on the other's warm or cold caches); {name: figure} a round."""
    names = list(measures)
    return [
        {name: round(measures[name](), 1) for name in (names if number % 2 == 0 else names[::-1])}
        for number in range(rounds)
    ]


MAX_COUNT = 100  # rounds, or generations a round: more only makes a run hours long
MAX_THREADS = 1024
MAX_TOKENS = 4096  # generated tokens a test: longer outgrows a small model's context


def refuse_bad_counts(args: argparse.Namespace) -> None:
    """Counts outside what can give a figure (no threads, no tokens, no repetition: llama-bench aborts
    or reports 0 tok/s) are refused in one line before anything runs."""
    ranges = {
        "--rounds": (args.rounds, 0, MAX_COUNT),
        "--runs": (args.runs, 1, MAX_COUNT),
        "--repetitions": (args.repetitions, 1, MAX_COUNT),
        "--threads": (args.threads, 1, MAX_THREADS),
        "--tokens": (args.tokens, 1, MAX_TOKENS),
    }
    for flag, (value, low, high) in ranges.items():
        if not low <= value <= high:
            refuse(f"{flag} {value}: from {low} to {high}")


def gguf_of(target: Path) -> Path:
    """A .gguf file as given, or the GGUF an artifact folder's recipe starts from (refused otherwise)."""
    if target.suffix == ".gguf":
        return target if target.is_file() else refuse(f"{target}: no such file")
    if not (target / "manifest.json").is_file():
        refuse(f"{target}: neither a .gguf file nor an artifact folder (no manifest.json)")
    gguf, why = recipe_gguf(artifact_manifest(target))
    return gguf if gguf is not None else refuse(why)


def measure(args: argparse.Namespace, binary: Path, gguf: Path) -> tuple[dict, str]:
    """The result of either mode and its summary line, llama-bench run with flags that can serve."""
    flags, note = serving_flags(binary, gguf, args.threads, args.llama_bench_args)
    if note:
        print(f"note: {note}")
    if args.rounds:
        result = decode_in_turns(args.target, binary, gguf, args, flags)
        summary = (
            f"medians of {args.rounds} rounds: llama-bench tg{args.tokens} {result['median_llama_bench']} tok/s, "
            f"artifact {result['median_artifact']} tok/s, {result['median_ratio']}x"
        )
    else:
        result = decode_reference(binary, gguf, args.threads, args.tokens, args.repetitions, flags)
        summary = (
            f"llama-bench {result['test']} on {gguf.name}, {result['threads']} threads, build {result['build']}: "
            f"{result['tokens_per_s']} +/- {result['stddev_tokens_per_s']} tok/s"
        )
    return {**result, "llama_bench_args": flags, "note": note}, summary


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__.split("\n\n")[1].strip())
    p.add_argument("target", type=Path, help="an artifact folder (its recipe's GGUF) or a .gguf file")
    p.add_argument("--llama-bench", default=None, help="the llama-bench binary (else $PEERS_LLAMA_BENCH or PATH)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument(
        "--llama-bench-args", type=shlex.split, default=[], help="more llama-bench flags ('-ub 1', '--repack 0')"
    )
    p.add_argument("--rounds", type=int, default=0, help="compare an artifact's own decode, in turns, this many rounds")
    p.add_argument("--runs", type=int, default=5, help="timed runs a round for each side (their median)")
    p.add_argument("--json", type=Path)
    figure_record.add_option(p)
    args = p.parse_args(argv)
    refuse_unwritable(args.json, args.record)
    refuse_bad_counts(args)
    if args.record and not args.rounds:
        refuse("--record keeps an artifact's decode against llama-bench: give --rounds N and the artifact folder")
    if args.rounds and args.target.suffix == ".gguf":
        refuse("--rounds compares an artifact's decode with llama-bench: give the artifact folder, not a .gguf")
    gguf = gguf_of(args.target)
    binary, why = find_tool(args.llama_bench, "PEERS_LLAMA_BENCH", "llama-bench", "--llama-bench")
    if binary is None:
        refuse(why)
    try:
        result, summary = measure(args, binary, gguf)
    except RuntimeError as exc:  # llama-bench failed: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(summary)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.record:
        fields = record_fields(artifact_manifest(args.target), args, gguf, result)
        figure_record.write(args, "benchmarks.llamacpp", argv, **fields)
    return result


def record_fields(manifest: dict, args: argparse.Namespace, gguf: Path, result: dict) -> dict:
    """The row of docs/figures.md's table an in-turns run measures: the artifact's one-sequence decode
    against llama-bench's on the same file."""
    ratios = [row["ratio"] for row in result["rounds"]]
    benches = [row["llama_bench"] for row in result["rounds"]]
    flags = " ".join(result.get("llama_bench_args") or [])
    engine, recipe = manifest["engine"].get("format"), manifest["recipe"]["name"]
    return {
        "measure": f"The {engine} artifact of {recipe} decoding one sequence, "
        f"{args.tokens} tokens after 64, in turns with llama-bench tg{args.tokens} on the same file "
        f"({gguf.name}), {args.rounds} rounds",
        "figure": f"{result['median_artifact']:.1f} tok/s",
        "ratio": f"{result['median_ratio']:.3f}x llama-bench tg{args.tokens} ({min(ratios):.3f}-{max(ratios):.3f} "
        f"by round; llama-bench {min(benches):.0f}-{max(benches):.0f} tok/s{', ' + flags if flags else ''})",
    }


if __name__ == "__main__":
    main()
