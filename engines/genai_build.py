"""ONNX Runtime GenAI's model builder: a Hugging Face causal-LM folder -> a decoder with KV cache,
tokenizer and genai_config.json (weight-only INT4/INT8 MatMulNBits on CPU), and a summary of which
weights kept which precision."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """The builder failed; the message is its last line of output."""


def build(
    source_dir: Path, out: Path, precision: str, execution_provider: str, options: list[str], cache: Path
) -> None:
    """Run the builder in a subprocess (it prints per-tensor progress; kept in a log file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(source_dir),
        "-m",
        str(source_dir),
        "-o",
        str(out),
        "-p",
        precision,
        "-e",
        execution_provider,
        "-c",
        str(cache),
    ]
    if options:
        command += ["--extra_options", *options]
    log.info("GenAI builder: %s", " ".join(command[3:]))
    logfile = out.parent / "builder.log"
    with open(logfile, "w") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        lines = [line for line in logfile.read_text(errors="replace").splitlines() if line.strip()]
        raise BuildError(f"the GenAI builder failed: {lines[-1][:300] if lines else 'no output'}")
    logfile.unlink()


def weight_precision(onnx_path: Path) -> dict:
    """Which weights kept which precision: MatMulNBits nodes by bit width, other weighted ops as stored."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    groups: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            bits = next((a.i for a in node.attribute if a.name == "bits"), 4)
            groups.setdefault(f"int{bits}", []).append(node.name)
        elif node.op_type in ("MatMul", "Gemm", "Gather") and any(i in weights for i in node.input):
            groups.setdefault("float", []).append(node.name)
    return {precision: {"count": len(names), "nodes": _summarize(names)} for precision, names in groups.items()}


def _summarize(names: list[str]) -> list[str]:
    """/model/layers.7/attn/qkv_proj/MatMul_Q4 -> layers.7/attn/qkv_proj (graph order kept)."""
    import re

    kinds = [
        re.sub(r"/model/", "", n).strip("/").replace("/MatMul", "").replace("_Q4", "").replace("_Q8", "") for n in names
    ]
    return list(dict.fromkeys(kinds))
