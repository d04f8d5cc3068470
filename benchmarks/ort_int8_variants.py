"""Where ONNX Runtime's dynamic INT8 gains (or loses) on MiniLM: fused vs unfused graphs, with and
without the sensitivity fallback, measured side by side in one process.

Variants, all on the same tokenized evaluation texts, timed in one measure() call per batch size:

- PyTorch FP32 (reference for cosine and speed ratios), ORT FP32 unfused and fused.
- fused + INT8 of every weight MatMul (the project's ort_int8_dynamic call, fallback off): the
  fused Attention node keeps its QKV projection in FP32, as op_types=[MatMul, Gemm] leaves it.
- fused + INT8 including the Attention node (QAttention): needs the graph edit in
  engines.onnxruntime.fusion.pack_attention_qkv.
- the artifact's model.onnx (the default recipe: fused, INT8, sensitivity fallback on).
- unfused + INT8 per-channel, reduce_range false and true.
- with --optimum-python: Optimum's own export + ORTQuantizer INT8 (the peer of benchmarks/peers.py).

For each graph it counts the op types in the file and in the graph ONNX Runtime actually runs (after
its own ENABLE_ALL rewrites), and profiles warm batch-32 runs of chosen graphs to show which
kernels take the time.

    .venv/bin/python -m benchmarks.ort_int8_variants --artifact DIR [--texts 64] [--json OUT]
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peers import (  # noqa: E402
    ARTIFACT,
    BASELINE,
    Entry,
    MeanPooled,
    artifact_encoder,
    default_model_dir,
    measure_fidelity,
    measure_latency,
    optimum_isa,
    optimum_peer,
    pytorch_baseline,
    texts,
    unfused_export,
)

COUNTED = (
    "MatMul",
    "FusedMatMul",
    "Gemm",
    "MatMulInteger",
    "DynamicQuantizeMatMul",
    "DynamicQuantizeLinear",
    "MatMulIntegerToFloat",
    "Attention",
    "QAttention",
    "MultiHeadAttention",
    "SkipLayerNormalization",
    "BiasGelu",
    "Gelu",
    "FastGelu",
    "Softmax",
)
PROFILED = (
    "fused INT8 (all MatMuls)",
    "fused INT8 + QAttention",
    "default (fallback on)",
    "unfused INT8 per-channel",
    "Optimum export INT8",
)
OPTIMUM = "Optimum export INT8"


def quantize(source: Path, out: Path, op_types: list[str], reduce_range: bool) -> Path:
    """The same quantize_dynamic call as the project's ort_int8_dynamic (per-channel, s8 weights)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        source,
        out,
        op_types_to_quantize=op_types,
        per_channel=True,
        reduce_range=reduce_range,
        weight_type=QuantType.QInt8,
    )
    return out


def build_graphs(module, example: dict, artifact: Path, work: Path) -> dict[str, Path]:
    import shutil

    from engines.onnxruntime.fusion import fuse_for_onnxruntime, pack_attention_qkv
    from optimize.quantize.common import auto_reduce_range

    unfused = unfused_export(module, example, work / "unfused.onnx")
    fused = shutil.copyfile(unfused, work / "fused.onnx")
    fuse_for_onnxruntime(fused)
    default_rr = auto_reduce_range(None)  # what the recipe picks on this CPU (False with VNNI)
    return {
        "ORT FP32 unfused": unfused,
        "ORT FP32 fused": fused,
        "fused INT8 (all MatMuls)": quantize(fused, work / "fused-int8.onnx", ["MatMul", "Gemm"], default_rr),
        "fused INT8 + QAttention": quantize(
            pack_attention_qkv(fused, work / "fused-packed.onnx")[0],
            work / "fused-int8-qattn.onnx",
            ["MatMul", "Gemm", "Attention"],
            default_rr,
        ),
        "default (fallback on)": artifact / "model.onnx",
        "unfused INT8 per-channel": quantize(unfused, work / "unfused-int8.onnx", ["MatMul", "Gemm"], False),
        "unfused INT8 per-channel rr": quantize(unfused, work / "unfused-int8-rr.onnx", ["MatMul", "Gemm"], True),
    }


def op_counts(path: Path, work: Path) -> dict[str, dict[str, int]]:
    """Op types in the file, and in the graph ONNX Runtime runs after its ENABLE_ALL rewrites."""
    import onnx
    import onnxruntime as ort

    from engines.onnxruntime.runner import session_options

    options = session_options()
    optimized = work / f"{path.stem}-{abs(hash(str(path)))}-ort.onnx"
    options.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def count(p: Path) -> dict[str, int]:
        ops = collections.Counter(n.op_type for n in onnx.load(str(p), load_external_data=False).graph.node)
        return {op: ops[op] for op in COUNTED if ops[op]}

    return {"file": count(path), "runtime": count(optimized)}


def profile(path: Path, batch: dict, work: Path, runs: int = 3) -> dict[str, float]:
    """Milliseconds per warm run spent in each op type (ORT's profiler); "(run)" is the whole run."""
    import onnxruntime as ort

    from engines.onnxruntime.runner import session_options

    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(work / f"profile-{path.stem}")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {i.name: batch[i.name] for i in session.get_inputs()}
    for _ in range(runs + 1):
        session.run(None, feed)
    return per_op_ms(json.loads(Path(session.end_profiling()).read_text()))


def per_op_ms(events: list[dict]) -> dict[str, float]:
    """Kernel time per op type, averaged over every run but the first (one-time allocations)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[1:]
    totals = collections.Counter()
    for e in events:
        if (
            e.get("cat") == "Node"
            and e.get("name", "").endswith("_kernel_time")
            and any(a <= e["ts"] <= b for a, b in spans)
        ):
            totals[e["args"]["op_name"]] += e["dur"] / 1e3
    result = {"(run)": sum(b - a for a, b in spans) / 1e3 / len(spans)}
    result.update({op: ms / len(spans) for op, ms in totals.most_common()})
    return result


def parse_args(argv=None):
    from serve import arguments as cli

    parser = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=cli.existing_dir, required=True, help="artifact of recipe=minilm_int8_cpu")
    parser.add_argument("--model", type=cli.existing_dir, default=None)
    parser.add_argument("--texts", type=cli.count(100_000), default=64)
    parser.add_argument("--batch-sizes", type=cli.joined(cli.number_list(int, 1, 4096)), default="1,32")
    parser.add_argument("--profile-batch", type=cli.count(4096), default=32)
    parser.add_argument("--repeats", type=cli.count(100_000), default=30)
    parser.add_argument("--retries", type=cli.count(100, low=0), default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--optimum-python",
        default=os.environ.get("PEERS_OPTIMUM_PYTHON"),
        help="venv python with optimum: adds Optimum's export + ORTQuantizer INT8 graph",
    )
    args = parser.parse_args(argv)
    from benchmarks.artifact_input import refuse_unwritable

    refuse_unwritable(args.json)
    args.model = args.model or default_model_dir()
    return args


def table(entries: list[Entry], counts: dict, latency: dict, keys: list[str]) -> str:
    from engines.hardware import cpu_flags
    from optimize.environment import cpu_model

    base = entries[0]
    head = ["graph", "min cos", "mean cos"] + [f"p50 ms b{b}" for b in keys] + [f"x PyTorch b{b}" for b in keys]
    head += ["ops in the graph ORT runs"]
    vnni = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in cpu_flags()]
    lines = [
        f"CPU: {cpu_model()} ({', '.join(vnni) or 'no VNNI'}); other_cpu_share: "
        + ", ".join(f"b{b} {latency[b]['other_cpu_share']:.3f}" for b in keys),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for e in entries:
        ops = counts.get(e.name, {}).get("runtime", {})
        row = [e.name, f"{e.fidelity['cosine_min']:.4f}", f"{e.fidelity['cosine_mean']:.4f}"]
        row += [f"{e.p50_ms[b]:.2f}" for b in keys] + [f"{base.p50_ms[b] / e.p50_ms[b]:.2f}" for b in keys]
        row.append(", ".join(f"{k} {v}" for k, v in ops.items()))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    from engines.hardware import cpu_flags
    from engines.onnxruntime.runner import OrtRunner
    from engines.pytorch.runner import read_pooling
    from optimize.evaluate.benchmark import BUSY_SHARE
    from optimize.evaluate.harness import batches_of

    args = parse_args(argv)
    keys = args.batch_sizes.split(",")
    encode = artifact_encoder(args.artifact)
    inputs = encode(texts("evaluation", args.texts, seed=1))
    with tempfile.TemporaryDirectory(prefix="ort-int8-") as tmp:
        work = Path(tmp)
        module, torch_runner = pytorch_baseline(args.model, 0)
        graphs = build_graphs(module, encode(texts("calibration", 2, seed=0)), args.artifact, work)
        entries = [Entry(BASELINE, "baseline", torch_runner, "")]
        entries += [
            Entry(name, ARTIFACT if "default" in name else "variant", OrtRunner(path), str(path.name))
            for name, path in graphs.items()
        ]
        if args.optimum_python:  # the TorchScript-style export Optimum writes, quantized its way
            path, recipe, _ = optimum_peer(
                args.optimum_python, args.model, graphs["ORT FP32 unfused"], work, optimum_isa(cpu_flags())
            )
            graphs[OPTIMUM] = path
            entries.append(
                Entry(OPTIMUM, "variant", MeanPooled(OrtRunner(path), read_pooling(Path(args.model))), recipe)
            )
        counts = {name: op_counts(path, work) for name, path in graphs.items()}
        measure_fidelity(entries, inputs)
        latency = {b: measure_latency(entries, inputs, int(b), 3, args.repeats, args.retries, BUSY_SHARE) for b in keys}
        batch = batches_of(inputs, args.profile_batch)[0]
        profiles = {name: profile(graphs[name], batch, work) for name in PROFILED if name in graphs}
    print(table(entries, counts, latency, keys))
    for name, ops in profiles.items():
        run, kernels = ops.pop("(run)"), sum(ops.values())
        top = ", ".join(f"{op} {ms:.1f} ({ms / kernels:.0%})" for op, ms in list(ops.items())[:7])
        print(f"\nprofile b{args.profile_batch} {name}: run {run:.1f} ms, kernels {kernels:.1f} ms: {top}")
    result = {
        "counts": counts,
        "profiles": profiles,
        "latency": latency,
        "runners": [{"name": e.name, "fidelity": e.fidelity, "p50_ms": e.p50_ms} for e in entries],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
