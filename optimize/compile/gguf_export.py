"""Engine stage for causal LMs: the model written as one GGUF file (optimize/export/gguf), the file
llama.cpp, Ollama and LM Studio run as it is, with an Ollama Modelfile beside it, and gated on that
exact file: the native GGUF kernels run it where they carry every type in it, else OpenVINO GenAI's
GGUF reader (its rounded scales made exact from the file), so the race scores and serves the
file's own weights. A type neither runs is this stage's one line. Where the source is a GGUF file
whose tensors already have the chosen mix's types, the artifact is that file.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
METHOD = "gguf"
GGUF_DIR = "gguf"
GGUF_NAME = "model.gguf"
SERVERS = ("auto", "native_gguf", "openvino_genai_gguf")


@dataclass
class GGUFExportConfig:
    """Example recipe (SmolLM2 as a Q4_K_M GGUF, K-quants rounded with an importance matrix from the
    recipe's calibration text):

        engine: {method: gguf, params: {type: Q4_K_M, imatrix: true}}

    type: Q8_0 | Q6_K | Q5_K_M | Q4_K_M | Q4_0 (llama.cpp's file types and its per-tensor mixes).
    """

    type: str = "Q4_K_M"
    # An importance matrix (mean squared input per channel, from the calibration text) for the
    # quantizers; Q8_0 ignores it, as llama.cpp's does.
    imatrix: bool = True
    calibration_samples: int = 32  # calibration texts read for the importance matrix
    max_tokens: int = 512  # tokens per calibration text
    # Which runtime gates and serves the file: auto (the native kernels where they carry every type,
    # else OpenVINO GenAI's reader), or one of them by name.
    serve_with: str = "auto"
    context: int = 0  # the native kernels' KV positions (0: the model's, at most their bound)

    def validate(self):
        from optimize.export.gguf import FILE_TYPES

        if self.type not in FILE_TYPES:
            raise RecipeError(f"engine.params.type={self.type!r} cannot be written (written: {', '.join(FILE_TYPES)})")
        if self.serve_with not in SERVERS:
            raise RecipeError(f"engine.params.serve_with={self.serve_with!r} (one of {', '.join(SERVERS)})")
        if self.calibration_samples < 1 or self.max_tokens < 2:
            raise RecipeError("engine.params.calibration_samples must be >= 1 and max_tokens >= 2")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 0:
            raise RecipeError(f"engine.params.context={self.context} (0: the model's, or a number of positions)")


@register(
    "engine",
    METHOD,
    GGUFExportConfig,
    input_format="torch",
    tasks=("causal_lm",),
    needs_calibration=True,
    engine_formats=(formats.NATIVE_GGUF, formats.OPENVINO_GENAI),
    requires=(
        ("gguf", "pip install gguf"),
        ("libgguf", "pip install 'optimize[llm]'"),
        ("jinja2", "pip install jinja2"),
    ),
)
def gguf_engine(model: Model, cfg: GGUFExportConfig, ctx: Context) -> Model:
    """The model as a GGUF of cfg.type plus its Modelfile, served by a runtime that reads the file."""
    from engines import gguf
    from optimize.compile.openvino_genai_gguf import precision_of
    from optimize.export.gguf import ExportError, modelfile

    if model.kind != "torch" or model.module is None:
        raise RecipeError(f"engine.method={METHOD} needs a Hugging Face causal LM")
    out = ctx.scratch / "gguf_engine"
    shutil.rmtree(out, ignore_errors=True)
    (out / GGUF_DIR).mkdir(parents=True)
    path = out / GGUF_DIR / GGUF_NAME
    try:
        record = write_or_carry(model, cfg, ctx, path)
        (path.parent / "Modelfile").write_text(modelfile.for_gguf(path), encoding="utf-8")
    except ExportError as exc:
        raise RecipeError(f"engine.method={METHOD}: {exc}") from None
    give_back_source_pages(model)
    architecture, tensors = gguf.tensors(path)
    engine, served = serve(path, architecture, tensors, cfg, ctx, out)
    record.update(served)
    record["modelfile"] = f"{GGUF_DIR}/Modelfile"
    return model.with_engine(out, engine, precision=precision_of(tensors)).recorded(record)


def give_back_source_pages(model: Model) -> None:
    """The writer read every weight of a memory-mapped source (a bf16 checkpoint): those pages are given
    back before the runtime that gates the file reads it, which needs its own copy of the weights (at
    Llama-3.2-1B's shape OpenVINO's GGUF reader peaked at 3.6 GB beside the source's 2.1 GB)."""
    from engines.pytorch.weight_pages import release

    released = release(model.module)
    if released:
        log.info("the source's weight pages given back after the write: %.1f GB", released / 1e9)


def write_or_carry(model: Model, cfg: GGUFExportConfig, ctx: Context, path: Path) -> dict:
    """Write the GGUF at `path` (or copy the source's, where it already is the chosen mix): the record."""
    from optimize.export.gguf import imatrix, writer

    source = ctx.loaded_source()
    source_file = Path(source.location) / source.gguf_file if source.gguf_file else None
    unchanged = model.module is source.module
    if source_file is not None and unchanged and already_of_type(source_file, cfg.type, model.module.config):
        shutil.copyfile(source_file, path)
        log.info("the GGUF source already is %s: carried as it is", cfg.type)
        return {"method": METHOD, "type": cfg.type, "weights": "as in the source", "imatrix": None}
    weights = None
    if cfg.imatrix and cfg.type != "Q8_0":
        sequences = calibration_sequences(ctx, cfg)
        with _imatrix_precision(model.module) as precision:
            log.info("importance matrix from %d calibration texts, computed in %s", len(sequences), precision)
            weights = imatrix.collect(model.module, sequences)
    tokenizer_dir = None if source_file else tokenizer_folder(ctx)
    log.info("writing %s GGUF", cfg.type)
    written = writer.write(
        model.module,
        path,
        cfg.type,
        tokenizer_dir=tokenizer_dir,
        tokenizer_gguf=source_file,
        imatrix=weights,
        name=Path(source.location).name,
    )
    record = {
        "method": METHOD,
        "type": cfg.type,
        "weights": "written from the model",
        "tensor_types": written.types,
        "imatrix": {"matrices": len(weights), "max_tokens": cfg.max_tokens} if weights else None,
        "gguf": metadata.version("gguf"),
    }
    if any(t in ("Q4_K", "Q5_K", "Q6_K") for t in written.types.values()) or weights:
        record["libgguf"] = metadata.version("libgguf")
    return record


@contextlib.contextmanager
def _imatrix_precision(module):
    """Computes the importance matrix's forward passes in a bf16/fp16 source's own precision where this
    CPU is faster in it (3-4x with AVX-512 BF16), else in FP32 a module at a time. An importance only
    weighs each input channel's rounding error, so it does not need the FP32 model's last bits;
    llama.cpp's imatrix tool computes a bf16 model's activations in bf16 too."""
    from engines.pytorch.half_compute import faster_precision
    from engines.pytorch.runner import fp32_compute

    precision, _ = faster_precision(module)
    with fp32_compute(module) if precision == "float32" else contextlib.nullcontext():
        yield precision


def already_of_type(source_file: Path, file_type: str, config) -> bool:
    """Whether every tensor of the GGUF source has the type the mix would give it."""
    from engines import gguf
    from optimize.export.gguf import mixes

    _, tensors = gguf.tensors(source_file)
    shapes = {t.name: tuple(reversed(t.shape)) for t in tensors}
    wanted = mixes.tensor_types(file_type, shapes, config.num_hidden_layers)
    return all(wanted[t.name] == t.type for t in tensors)


def calibration_sequences(ctx: Context, cfg: GGUFExportConfig) -> list[list[int]]:
    from optimize.evaluate.generation import Tokens

    tokens = Tokens(ctx)
    texts = ctx.calibration().items[: cfg.calibration_samples]
    sequences = [tokens(text)[: cfg.max_tokens] for text in texts]
    sequences = [s for s in sequences if len(s) >= 2]
    if not sequences:
        raise RecipeError(f"engine.method={METHOD}: the calibration texts gave no sequence of 2 or more tokens")
    return sequences


def tokenizer_folder(ctx: Context) -> Path:
    from optimize.sources.models import hf_folder

    return hf_folder(ctx.loaded_source())


def serve(path: Path, architecture: str, tensors, cfg: GGUFExportConfig, ctx: Context, out: Path) -> tuple[dict, dict]:
    """(engine block, record) of the runtime that gates and serves the file."""
    from engines.native_gguf import model as native
    from engines.openvino import genai_gguf

    native_reason = native.uncarried(architecture, tensors)
    ov_reason = genai_gguf.uncarried(architecture, tensors)
    chosen = cfg.serve_with
    if chosen == "auto":
        chosen = "native_gguf" if native_reason is None else "openvino_genai_gguf" if ov_reason is None else ""
    reason = {"native_gguf": native_reason, "openvino_genai_gguf": ov_reason}.get(chosen)
    if not chosen or reason:
        why = reason or f"{native_reason}; {ov_reason}"
        raise RecipeError(f"engine.method={METHOD}: the {cfg.type} file cannot be gated on the file itself here: {why}")
    if chosen == "native_gguf":
        from optimize.compile.native_gguf import package

        engine, record = package(path, tensors, tokenizer_folder(ctx), out / GGUF_DIR, cfg.context, METHOD)
        return engine, {"served_by": "native_gguf", **record}
    return openvino_reader(path, tensors, ctx, out)


def openvino_reader(path: Path, tensors, ctx: Context, out: Path) -> tuple[dict, dict]:
    from engines.openvino import genai_gguf
    from engines.openvino.genai_build import convert_tokenizer, copy_configs
    from optimize.compile.openvino_genai_gguf import ENGINE_DIR, EXACT

    engine_dir = out / ENGINE_DIR
    try:
        patched, fused = genai_gguf.build_from_gguf(path, engine_dir, EXACT)
    except genai_gguf.CarryError as exc:
        raise RecipeError(f"engine.method={METHOD}: {exc}") from None
    folder = tokenizer_folder(ctx)
    convert_tokenizer(folder, engine_dir)
    copy_configs(folder, engine_dir, ctx.loaded_source().module.config)
    record = {
        "served_by": "openvino_genai_gguf",
        "gguf_file": f"{GGUF_DIR}/{path.name}",
        "gguf_types": genai_gguf.type_summary(tensors),
        "made_exact": patched,
        "fused_projections": fused,
        "openvino_genai": metadata.version("openvino-genai"),
        "kv_cache_precision": "f32",
    }
    engine = {
        "format": formats.OPENVINO_GENAI,
        "dir": ENGINE_DIR,
        "inference_precision": "f32",
        "kv_cache_precision": "f32",
    }
    return engine, record
