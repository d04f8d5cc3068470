"""Engine stage for causal LMs: ONNX Runtime GenAI's model builder (decoder with KV cache, tokenizer,
genai_config.json), weight-only INT4/INT8 MatMulNBits on CPU."""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
ENGINE_DIR = "genai"
ALGOS = ("default", "rtn", "k_quant", "rtn_last", "k_quant_last", "k_quant_mixed")


@dataclass
class GenAIConfig:
    """Example recipe (INT4 body, INT8 LM head, k-quant scales):

        engine:
          method: onnxruntime_genai
          params: {precision: int4, block_size: 32, algo_config: k_quant_last, accuracy_level: 4}

    The builder's options are named as in `python -m onnxruntime_genai.models.builder --extra_options`;
    `extra_options` passes any other KEY=VALUE through unchanged.
    """

    precision: str = "int4"  # int4 | int8 | fp32
    execution_provider: str = "cpu"
    block_size: int = 32
    is_symmetric: bool = True
    accuracy_level: Optional[int] = None  # 4: int8 activations inside MatMulNBits (CPU default), 1: fp32
    algo_config: str = "default"
    matmul_mixed_precision: Optional[str] = None  # e.g. "last_matmul:int8" (the LM head at 8 bits)
    nodes_to_exclude: List[str] = field(default_factory=list)  # stay FP32, e.g. ["/lm_head/MatMul"]
    extra_options: Dict[str, Any] = field(default_factory=dict)

    def validate(self):
        if self.precision not in ("int4", "int8", "fp32", "fp16"):
            raise RecipeError(f"engine.params.precision={self.precision} (use int4, int8, fp32 or fp16)")
        if self.algo_config not in ALGOS:
            raise RecipeError(f"engine.params.algo_config={self.algo_config} (use one of {', '.join(ALGOS)})")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise RecipeError(f"engine.params.block_size={self.block_size} (use 16, 32, 64, 128 or 256)")
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise RecipeError(f"engine.params.accuracy_level={self.accuracy_level} (use 1, 2, 3 or 4)")

    def builder_options(self) -> list[str]:
        options = {"block_size": self.block_size, "is_symmetric": self.is_symmetric,
                   "algo_config": self.algo_config, "accuracy_level": self.accuracy_level,
                   "matmul_mixed_precision": self.matmul_mixed_precision,
                   "nodes_to_exclude": ",".join(self.nodes_to_exclude) or None, **self.extra_options}
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items() if v is not None]


@register("engine", "onnxruntime_genai", GenAIConfig, input_format="torch", tasks=("causal_lm",))
def onnxruntime_genai_engine(model, cfg: GenAIConfig, ctx):
    """Build an ONNX Runtime GenAI decoder with KV cache (weight-only INT4/INT8 via MatMulNBits)."""
    if model.kind != "torch":
        raise RecipeError("engine.method=onnxruntime_genai needs a Hugging Face causal LM")
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise RecipeError("engine.method=onnxruntime_genai needs onnxruntime-genai: pip install onnxruntime-genai") from None
    source_dir = _source_folder(model, ctx)
    out = ctx.scratch / "genai_engine"
    shutil.rmtree(out, ignore_errors=True)
    build(source_dir, out / ENGINE_DIR, cfg, ctx.scratch / "genai_cache")
    layers = layer_precision(out / ENGINE_DIR / "model.onnx")
    ctx.record("engine", {"method": "onnxruntime_genai", "builder_options": cfg.builder_options(),
                          "precision": cfg.precision, "layer_precision": layers})
    engine = {"format": "onnxruntime-genai", "dir": ENGINE_DIR, "providers": [_provider(cfg.execution_provider)]}
    return model.with_engine(out, engine, precision=cfg.precision)


def _source_folder(model, ctx) -> Path:
    """The builder reads a Hugging Face folder: the (cached) source, or the module a torch-side method changed."""
    from optimize import llm

    if model.module is ctx.source.module:
        return llm.hf_folder(ctx.source)
    folder = ctx.scratch / "genai_input"
    model.module.save_pretrained(str(folder))
    tokenizer_src = llm.hf_folder(ctx.source)
    for path in tokenizer_src.glob("*"):
        if path.suffix in (".json", ".jinja", ".txt", ".model") and path.name not in ("config.json",):
            shutil.copy2(path, folder / path.name)
    return folder


def build(source_dir: Path, out: Path, cfg: GenAIConfig, cache: Path) -> None:
    """Run the builder in a subprocess (it prints per-tensor progress; kept in a log file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source_dir), "-m",
               str(source_dir), "-o", str(out), "-p", cfg.precision, "-e", cfg.execution_provider,
               "-c", str(cache)]
    options = cfg.builder_options() if cfg.precision in ("int4", "int8") else []
    if options:
        command += ["--extra_options", *options]
    log.info("GenAI builder: %s", " ".join(command[3:]))
    logfile = out.parent / "builder.log"
    with open(logfile, "w") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        lines = [l for l in logfile.read_text(errors="replace").splitlines() if l.strip()]
        raise RecipeError(f"the GenAI builder failed: {lines[-1][:300] if lines else 'no output'}")
    logfile.unlink()


def layer_precision(onnx_path: Path) -> dict:
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

    kinds = [re.sub(r"/model/", "", n).strip("/").replace("/MatMul", "").replace("_Q4", "").replace("_Q8", "")
             for n in names]
    return list(dict.fromkeys(kinds))


def _provider(name: str) -> str:
    return {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}.get(name, name)
