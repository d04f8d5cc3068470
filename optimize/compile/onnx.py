"""Engine stage: turn the (optimized) PyTorch model into the engine the artifact ships.

The checked export is kept in the verified cache (optimize/cache_store.py, OPTIMIZE_CACHE/export/)
under the hash of what it was made from: the weights, the calibration texts its check reads, the
model's settings, the export's own and the package versions. A second run on the same weights (a
sweep over quantization settings, a rerun with another gate) reuses the graph and its check instead
of tracing the model again (8 of a MiniLM run's 16 s on 2 cores). A cached graph is used only when
its files match the signed record sealed when it was exported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from engines import formats
from optimize import tasks
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)


@dataclass
class OnnxExportConfig:
    opset: int = 18
    atol: float = 1e-4  # max abs difference allowed between PyTorch and the exported graph
    min_cosine: float = 0.9999
    check_samples: int = 8  # calibration texts used for the fidelity check
    # Fuse the exported graph into ONNX Runtime's contrib kernels (Attention with packed QKV,
    # SkipLayerNormalization, BiasGelu, RotaryEmbedding...) with onnxscript's ORT rewrite rules.
    # The dynamo export spells attention as ~20 small ops; fused, MiniLM FP32 ran ~1.1x faster on CPU.
    # false for engines that cannot run com.microsoft ops (TensorRT without ORT, other runtimes).
    ort_fusions: bool = True

    def validate(self):
        if self.check_samples < 1:
            raise RecipeError("engine.params.check_samples must be at least 1")


@register("engine", "onnx", OnnxExportConfig, input_format="torch", engine_formats=(formats.ONNXRUNTIME,))
def onnx_engine(model: Model, cfg: OnnxExportConfig, ctx: Context) -> Model:
    """Export to ONNX (dynamo exporter), verified against PyTorch; runs on ONNX Runtime."""
    out = ctx.scratch / "onnx"
    out.mkdir(parents=True, exist_ok=True)
    if model.onnx_path is not None:  # already an ONNX graph: the engine ships it as it is
        from engines.onnxruntime.export import copy_onnx

        return model.with_onnx(copy_onnx(model.onnx_path, out))
    if model.kind != "torch":
        raise RecipeError("engine.method=onnx needs a PyTorch or ONNX model")
    key = export_key(model, cfg, ctx)
    reused = reuse_export(key, out)
    if reused is not None:
        path, record = reused
        log.debug("engine: onnx: the checked export of these weights reused from the cache (%s)", key[:12])
        return model.with_onnx(path).recorded({**record, "from_cache": True})
    path, record = export_checked(model, cfg, ctx, out)
    keep_export(key, path, record)
    return model.with_onnx(path).recorded(record)


def export_checked(model: Model, cfg: OnnxExportConfig, ctx: Context, out: Path) -> tuple[Path, dict]:
    """The model exported into `out`, fused for ONNX Runtime where asked and checked against PyTorch on
    calibration texts: (its model.onnx, the record)."""
    from engines.onnxruntime.export import ExportMismatch, check_fidelity, export
    from engines.onnxruntime.fusion import fuse_for_onnxruntime
    from engines.onnxruntime.runner import OrtRunner
    from engines.pytorch.runner import TorchRunner

    task = tasks.get(model.task)
    module = task.module(model.module, ctx)
    texts = ctx.calibration().items[: cfg.check_samples]
    example = ctx.encode(texts[:2])
    path = export(module, example, list(task.output_names), out / "model.onnx", task.dynamic_axes, cfg.opset)
    fusions = fuse_for_onnxruntime(path) if cfg.ort_fusions else {}
    check_inputs = ctx.encode(texts)
    reference = TorchRunner(module, list(task.input_names), list(task.output_names))(check_inputs)
    try:
        report = check_fidelity(reference, OrtRunner(path)(check_inputs), cfg.atol, cfg.min_cosine)
    except ExportMismatch as exc:
        raise RecipeError(str(exc)) from None
    return path, {"method": "onnx", "opset": cfg.opset, "ort_fusions": fusions, "export_check": report}


def export_key(model: Model, cfg: OnnxExportConfig, ctx: Context) -> str:
    """The cache key of the checked export: what it is built from (cache_store.build_identity: weights,
    calibration texts, packages, CPU), the model's settings and the export's."""
    from optimize import cache_store

    what = {
        "built_from": cache_store.build_identity(model, ctx),
        "model": dataclasses.asdict(ctx.plan.model),
        "export": dataclasses.asdict(cfg),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _export_folder(key: str) -> Path:
    from optimize.sources.models import cache_root

    return cache_root() / "export" / key[:24]


def reuse_export(key: str, out: Path) -> tuple[Path, dict] | None:
    """(the cached graph copied into `out`, its record) when the cache holds a verified export under
    `key`; None otherwise (a folder there that fails its check is removed, to be exported again)."""
    from engines.onnxruntime.export import copy_onnx
    from optimize import cache_store

    where = _export_folder(key)
    record = cache_store.verified_json(where, key, "export.json", "engine: onnx: the cached export", "exported again")
    if record is None or not (where / "model.onnx").is_file():
        return None
    return copy_onnx(where / "model.onnx", out), record


def keep_export(key: str, path: Path, record: dict) -> None:
    """Seal the checked export into the cache; a cache that cannot be written only costs the next run
    the export (said in the log), never this run."""
    from engines.onnxruntime.export import copy_onnx
    from optimize import cache_store

    where = _export_folder(key)
    tmp = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_store.staging(where)
        copy_onnx(path, tmp)
        (tmp / "export.json").write_text(json.dumps(record, default=str))
        cache_store.seal(tmp, where, key)
    except OSError as exc:
        log.warning("engine: onnx: the export was not kept in the cache (%s)", exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
