"""python -m optimize.export.gguf MODEL OUT.gguf --type TYPE [--calibration-text FILE]

MODEL is a Hugging Face folder (safetensors, config, tokenizer.json) or a GGUF file (read
dequantized; its tokenizer keys are copied). The Modelfile is written beside OUT. A model, type or
tokenizer the writer cannot write is one line and exit 2, with nothing written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optimize.export.gguf import FILE_TYPES, ExportError


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m optimize.export.gguf", description=__doc__.split("\n\n")[1])
    parser.add_argument("model", type=Path, help="a Hugging Face model folder or a .gguf file")
    parser.add_argument("out", type=Path, help="the GGUF file to write (the Modelfile goes beside it)")
    parser.add_argument("--type", default="Q4_K_M", help=f"one of {', '.join(FILE_TYPES)} (default Q4_K_M)")
    parser.add_argument(
        "--calibration-text",
        type=Path,
        help="a UTF-8 text file whose paragraphs (blank-line separated) give the importance matrix",
    )
    parser.add_argument("--calibration-tokens", type=int, default=256, help="tokens per paragraph (default 256)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        written = export(args)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written.path} ({written.file_type}: {written.summary()}) and {written.path.parent / 'Modelfile'}")
    return 0


def export(args: argparse.Namespace):
    from optimize.export.gguf import check_file_type, imatrix, modelfile, writer

    check_file_type(args.type)
    if args.calibration_tokens < 2:
        raise ExportError(f"--calibration-tokens={args.calibration_tokens} must be at least 2")
    if not args.out.parent.is_dir():
        raise ExportError(f"{args.out.parent} is not a folder to write {args.out.name} into")
    from engines.pytorch.runner import fp32_compute

    module, tokenizer, source_gguf = load(args.model)
    weights = None
    if args.calibration_text is not None:
        sequences = calibration_sequences(args.calibration_text, tokenizer, args.calibration_tokens)
        with fp32_compute(module):  # a bf16/fp16 folder: the FP32 model's activations, a module at a time
            weights = imatrix.collect(module, sequences)
    written = writer.write(
        module,
        args.out,
        args.type,
        tokenizer_dir=None if source_gguf else args.model,
        tokenizer_gguf=source_gguf,
        imatrix=weights,
    )
    (args.out.parent / "Modelfile").write_text(modelfile.for_gguf(args.out), encoding="utf-8")
    return written


def load(model: Path):
    """(module, tokenizer, the GGUF file or None) for a model folder or GGUF file. A bf16/fp16 folder
    stays memory-mapped in its own precision (the writer converts a block of rows at a time), a GGUF
    file is read dequantized to FP32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from engines.pytorch.runner import source_precision

    if model.is_file() and model.suffix == ".gguf":
        location, gguf_file = str(model.parent), model.name
    elif (model / "config.json").is_file():
        location, gguf_file = str(model), None
    else:
        raise ExportError(f"{model} is neither a Hugging Face model folder (config.json) nor a .gguf file")
    from optimize.export.gguf.writer import architecture_of

    architecture_of(AutoConfig.from_pretrained(location, gguf_file=gguf_file))  # refused before weights load
    precision = "float32" if gguf_file else source_precision(model)
    module = AutoModelForCausalLM.from_pretrained(location, gguf_file=gguf_file, dtype=getattr(torch, precision))
    tokenizer = AutoTokenizer.from_pretrained(location, gguf_file=gguf_file)
    return module.eval(), tokenizer, (model if gguf_file else None)


def calibration_sequences(path: Path, tokenizer, tokens: int) -> list[list[int]]:
    if not path.is_file():
        raise ExportError(f"--calibration-text={path}: no such file")
    paragraphs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return [tokenizer(p)["input_ids"][:tokens] for p in paragraphs]


if __name__ == "__main__":
    sys.exit(main())
