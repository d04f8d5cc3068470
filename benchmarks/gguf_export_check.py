"""The GGUF writer (optimize/export/gguf) against llama.cpp on one model, and the importance matrix's
worth:

    .venv/bin/python -m benchmarks.gguf_export_check MODEL_DIR OUT_DIR [--llama-quantize PATH] [--json OUT]

1. Byte-identity: the model written as an F32 GGUF, quantized by llama.cpp's `llama-quantize` to each
   type (with the same importance matrix, saved in llama.cpp's imatrix GGUF layout, and without),
   against the writer's own file of that type: each tensor's type and bytes. Skipped (and said so)
   where no llama-quantize is given or found ($PEERS_LLAMA_QUANTIZE).
2. The importance matrix's worth: Q4_K_M written with it and without it, each file read back
   dequantized (transformers' GGUF reader: the file's exact weights) and run in PyTorch on held-out
   text (cpython_docs' evaluation split, never the calibration split the matrix came from); the mean
   token-level KL divergence from the FP32 model and the top-1 agreement, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks import figure_record
from benchmarks.artifact_input import refuse, refuse_unwritable

TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_export_check")
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-quantize", default=os.environ.get("PEERS_LLAMA_QUANTIZE"))
    parser.add_argument("--calibration-texts", type=int, default=64)
    parser.add_argument("--eval-texts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per text (calibration and evaluation)")
    parser.add_argument("--json", type=Path)
    figure_record.add_option(parser)
    args = parser.parse_args(argv)
    refuse_unwritable(args.json, args.record)
    if args.record and not (args.llama_quantize and Path(args.llama_quantize).is_file()):
        refuse("--record keeps the files' identity with llama-quantize's: give --llama-quantize FILE")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimize.export.gguf import imatrix, writer

    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    calib = texts("calibration", args.calibration_texts, tokenizer, args.tokens)
    held_out = texts("evaluation", args.eval_texts, tokenizer, args.tokens)
    means = imatrix.collect(model, calib)
    imatrix.save_gguf(args.out / "imatrix.gguf", means, "cpython_docs:calibration", len(calib), args.tokens)
    result: dict = {"calibration_tokens": sum(map(len, calib)), "evaluation_tokens": sum(map(len, held_out))}
    files = {}
    for kind in TYPES:
        for use in (False, True) if kind != "Q8_0" else (False,):
            name = f"{kind}{'-imatrix' if use else ''}"
            files[name] = writer.write(
                model, args.out / f"{name}.gguf", kind, tokenizer_dir=args.model, imatrix=means if use else None
            ).path
    result["llama_quantize"] = compare_with_llama_cpp(args, model, files)
    result["imatrix_worth"] = imatrix_worth(model, files, held_out)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.record:
        figure_record.write(args, "benchmarks.gguf_export_check", argv, **record_fields(args.model, result))
    return 0


def record_fields(model: Path, result: dict) -> dict:
    """The row of docs/figures.md's table this run measures: how many of the writer's files have the same
    type and the same bytes in every tensor as llama-quantize's of the same type."""
    compared = {name: row for name, row in result["llama_quantize"].items() if "tensors" in row}
    same = [name for name, row in compared.items() if row["same_bytes"] == row["tensors"]]
    tensors = sorted({row["tensors"] for row in compared.values()})
    plain = [name for name in result["llama_quantize"] if not name.endswith("-imatrix")]
    weighted = [name.removesuffix("-imatrix") for name in result["llama_quantize"] if name.endswith("-imatrix")]
    differ = sorted(set(result["llama_quantize"]) - set(same))
    return {
        "measure": f"The GGUF writer (optimize/export_gguf) against llama.cpp's llama-quantize on {model.name}: "
        f"{', '.join(plain)}, and {', '.join(weighted)} with the same importance matrix",
        "figure": f"{len(same)} of {len(result['llama_quantize'])} files: the same type and the same bytes in all "
        f"{' or '.join(map(str, tensors))} tensors" + (f" (not: {', '.join(differ)})" if differ else ""),
        "ratio": "identical to llama-quantize's" if not differ else None,
    }


def texts(split: str, count: int, tokenizer, tokens: int) -> list[list[int]]:
    import calibration

    items = calibration.load("cpython_docs", split, count, 0, min_chars=200).items
    return [ids for ids in (tokenizer(t)["input_ids"][:tokens] for t in items) if len(ids) >= 2]


def f32_file(model, path: Path, tokenizer_dir: Path) -> Path:
    """The model with every tensor F32, the input llama-quantize takes."""
    from optimize.export.gguf import mixes, writer

    original = mixes.tensor_types
    mixes.tensor_types = lambda file_type, shapes, *a, **k: {n: "F32" for n in shapes}
    try:
        writer.write(model, path, "Q8_0", tokenizer_dir=tokenizer_dir)
    finally:
        mixes.tensor_types = original
    return path


def compare_with_llama_cpp(args, model, files: dict) -> dict:
    import gguf

    if not args.llama_quantize or not Path(args.llama_quantize).is_file():
        return {"skipped": "no llama-quantize (--llama-quantize or $PEERS_LLAMA_QUANTIZE)"}
    source = f32_file(model, args.out / "f32.gguf", args.model)
    report: dict[str, dict] = {}
    for name, ours in files.items():
        kind, _, with_imatrix = name.partition("-")
        theirs = args.out / f"llama-{name}.gguf"
        command = [args.llama_quantize]
        if with_imatrix:
            command += ["--imatrix", str(args.out / "imatrix.gguf")]
        command += [str(source), str(theirs), kind, "1"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            report[name] = {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
            continue
        a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
        mine = {t.name: t for t in a.tensors}
        same_type = same_bytes = 0
        differ: list[str] = []
        for t in b.tensors:
            m = mine.get(t.name)
            if m is None:
                differ.append(f"{t.name}: missing")
                continue
            same_type += m.tensor_type == t.tensor_type
            equal = m.tensor_type == t.tensor_type and np.array_equal(np.asarray(m.data), np.asarray(t.data))
            same_bytes += equal
            if not equal:
                differ.append(f"{t.name}: {m.tensor_type.name} vs {t.tensor_type.name}")
        report[name] = {
            "tensors": len(b.tensors),
            "same_type": same_type,
            "same_bytes": same_bytes,
            "differ": differ[:8],
        }
    return report


WORTH = ("Q4_K_M", "Q4_K_M-imatrix", "Q5_K_M", "Q5_K_M-imatrix", "Q4_0", "Q4_0-imatrix")


def imatrix_worth(model, files: dict, held_out: list[list[int]]) -> dict:
    """Mean token KL divergence from `model` and top-1 agreement of each file, one held-out text at a
    time (a text's reference log-probabilities are computed once and dropped)."""
    import torch

    candidates = {name: load_gguf(files[name]) for name in WORTH}
    sums = {name: [0.0, 0, 0] for name in WORTH}
    with torch.inference_mode():
        for ids in held_out:
            inputs = torch.tensor([ids])
            p = torch.log_softmax(model(input_ids=inputs).logits[0].double(), -1)
            for name, candidate in candidates.items():
                q = torch.log_softmax(candidate(input_ids=inputs).logits[0].double(), -1)
                sums[name][0] += float((p.exp() * (p - q)).sum())
                sums[name][1] += int((p.argmax(-1) == q.argmax(-1)).sum())
                sums[name][2] += p.shape[0]
    out: dict = {n: {"mean_kld": k / t, "top1_agreement": a / t, "tokens": t} for n, (k, a, t) in sums.items()}
    for kind in ("Q4_K_M", "Q5_K_M", "Q4_0"):
        out[f"{kind} kld ratio (imatrix / none)"] = out[f"{kind}-imatrix"]["mean_kld"] / out[kind]["mean_kld"]
    return out


def load_gguf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


if __name__ == "__main__":
    sys.exit(main())
