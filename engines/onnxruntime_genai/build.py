"""ONNX Runtime GenAI's model builder: a Hugging Face causal-LM folder -> a decoder with KV cache,
tokenizer and genai_config.json (weight-only INT4/INT8 MatMulNBits on CPU), and a summary of which
weights kept which precision."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from engines import memprobe

log = logging.getLogger(__name__)
# The scope of the nodes that add a carried GGUF Q4_1 matrix's block offsets (engines/onnxruntime_genai/gguf.py).
OFFSET_SCOPE = "/gguf_offset/"


class BuildError(RuntimeError):
    """The builder failed; the message is its last line of output, or how the kernel ended it."""


def build(
    source_dir: Path, out: Path, precision: str, execution_provider: str, options: list[str], cache: Path
) -> None:
    """Run the builder in a subprocess (it prints per-tensor progress; kept in a log file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "engines.onnxruntime_genai.build",  # the builder, reading transformers-5 configs (builder_config below)
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
    if not any(o.startswith("windowed_kv_cache=") for o in options):
        # Sliding-window layers keep a full-length cache, as transformers does: the bounded ring the
        # builder makes by default refuses a prompt longer than the window appended in one call
        # ("total_sequence_length must equal past_sequence_length + kv_sequence_length").
        options = [*options, "windowed_kv_cache=false"]
    command += ["--extra_options", *options]
    log.info("GenAI builder: %s", " ".join(command[3:]))
    logfile = out.parent / "builder.log"
    with open(logfile, "w") as f:
        returncode, _, killed = memprobe.run_watched(command, stdout=f, stderr=subprocess.STDOUT)
    if killed:  # its last line is whatever it printed before the kernel ended it: not why it failed
        raise BuildError(f"the GenAI builder was {killed}")
    if returncode != 0 or not (out / "genai_config.json").is_file():
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
            if OFFSET_SCOPE in node.name:  # a carried Q4_1 or Q4_K matrix's offsets, part of its MatMulNBits
                continue
            groups.setdefault("float", []).append(node.name)
    return {precision: {"count": len(names), "nodes": _summarize(names)} for precision, names in groups.items()}


def _summarize(names: list[str]) -> list[str]:
    """/model/layers.7/attn/qkv_proj/MatMul_Q4 -> layers.7/attn/qkv_proj (graph order kept)."""
    import re

    kinds = [
        re.sub(r"/model/", "", n).strip("/").replace("/MatMul", "").replace("_Q4", "").replace("_Q8", "") for n in names
    ]
    return list(dict.fromkeys(kinds))


# ---------------------------------------------------------------- the builder, on transformers-5 configs

# The builder (onnxruntime-genai 0.18) reads the rope settings as transformers 4 wrote them: one flat
# rope_parameters with rope_type (and "type" for Phi-3's LongRoPE), Gemma 3's local theta as
# rope_local_base_freq. Transformers 5 nests Gemma 3's per layer type ({"full_attention": {...},
# "sliding_attention": {...}}) and drops rope_local_base_freq, so the builder stopped with
# KeyError: 'rope_type'. The config it loads is re-standardized by transformers from any config.json
# we write, so the adaptation happens on the loaded config, in the builder's own process.


def builder_config(config: Any) -> Any:
    """The loaded config with the fields the builder reads (in place; returns it)."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_type" not in rope:
        full, sliding = rope.get("full_attention"), rope.get("sliding_attention")
        if isinstance(full, dict):  # per layer type: the global layers' settings are the model's
            rope.update({k: v for k, v in full.items() if k not in rope})
        if isinstance(sliding, dict) and "rope_theta" in sliding:
            config.rope_local_base_freq = sliding["rope_theta"]
        rope.setdefault("rope_type", "default")
    if isinstance(rope, dict):
        rope.setdefault("type", rope["rope_type"])
        if "rope_theta" in rope and getattr(config, "rope_theta", None) is None:
            config.rope_theta = rope["rope_theta"]
    if getattr(config, "sliding_window", None) and getattr(config, "layer_types", None) is None:
        # Mistral: a window and no layer types means every layer slides (as transformers runs it); the
        # builder reads the window per layer from layer_types and made every layer full otherwise.
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    if getattr(config, "model_type", None) == "phi3" and (rope or {}).get("rope_type") != "longrope":
        # The builder takes original != max positions for LongRoPE; without LongRoPE transformers
        # ignores original_max_position_embeddings, so making them equal changes nothing else.
        config.original_max_position_embeddings = config.max_position_embeddings
    return config


def _run_builder() -> None:
    """python -m engines.onnxruntime_genai.build ARGS: the builder's command line, on configs adapted as above."""
    import runpy

    from transformers import AutoConfig

    # The class itself, not the name: transformers' lazy module sets its names again on later imports.
    # This process runs only the builder.
    load = AutoConfig.from_pretrained
    AutoConfig.from_pretrained = lambda *args, **kwargs: builder_config(load(*args, **kwargs))  # type: ignore[method-assign]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_builder()
