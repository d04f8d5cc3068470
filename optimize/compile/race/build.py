"""Building the candidates: one checked ONNX export they all start from, then each candidate's
registered methods (or its copy from the cache)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any, Optional

from engines.onnxruntime.export import copy_onnx
from optimize.compile.race import cache
from optimize.compile.race.entry import Entry
from optimize.errors import RecipeError

log = logging.getLogger(__name__)


def export_once(model, ctx) -> tuple[Any, Optional[dict]]:
    """One checked ONNX export (fused for ONNX Runtime) that every candidate starts from, and its
    record (None for a model that came as ONNX)."""
    from optimize.compile.onnx import OnnxExportConfig, onnx_engine

    if model.kind == "onnx":
        return model, None
    exported = onnx_engine(model, OnnxExportConfig(), ctx)
    folder = ctx.scratch / "race" / "export"
    folder.mkdir(parents=True, exist_ok=True)
    copied = exported.with_onnx(copy_onnx(exported.onnx_path, folder))
    return dataclasses.replace(copied, record={}), exported.record


def build(entry: Entry, exported, ctx, key_base: Optional[str]) -> None:
    """Build one candidate from the export (or take it from the cache); a candidate that cannot be
    built here (no OpenVINO, no bf16, a method that does not apply) is recorded, not fatal."""
    from optimize import registry

    if key_base:  # a cached candidate is used only when it verifies; why not is reported
        entry.model, entry.records, why = cache.load_cached(key_base, entry.spec, exported)
        if entry.model is not None:
            entry.cached = True
            return
        entry.cache_rebuilt = "" if why == "not cached" else why
    start = time.monotonic()
    records: dict = {}  # {stage: record} of this candidate's methods
    try:
        methods = [("engine", entry.spec.engine, entry.spec.engine_params)]
        if entry.spec.quantize:
            methods.append(("quantize", entry.spec.quantize, entry.spec.quantize_params))
        built = exported
        for stage, name, params in methods:
            method = registry.get(stage, name)
            built = method.fn(built, registry.build_config(method, dict(params)), ctx).file_into(records, stage)
    except RecipeError as exc:
        entry.outcome = f"not built: {exc}"
        log.info("race: %s not built: %s", entry.name, exc)
        return
    entry.build_s = time.monotonic() - start
    if key_base:
        entry.model = cache.save(built, records, cache.folder(key_base, entry.spec), cache.key_of(key_base, entry.spec))
    else:
        entry.model = cache.save(built, records, ctx.scratch / "race" / entry.name)
    entry.records = records


class progress:
    """A progress bar on a terminal (tqdm), nothing in logs and CI."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=not sys.stderr.isatty(), leave=False)

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        self.bar.close()
        return False
