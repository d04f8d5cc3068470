"""Helpers the ONNX Runtime quantize methods share: input checks, scratch folders, calibration batches,
and the CPU-dependent weight range."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from engines.hardware import cpu_has_vnni
from optimize.errors import RecipeError


def require_onnx(model, method: str) -> None:
    if model.kind != "onnx":
        raise RecipeError(f"quantize.method={method} needs an ONNX model (engine.method=onnx)")


def workdir(ctx, name: str = "quantize") -> Path:
    out = ctx.scratch / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def auto_reduce_range(setting: Optional[bool]) -> bool:
    """7-bit weights on CPUs without VNNI: AVX2's u8*s8 pair sums (vpmaddubsw) saturate int16 with
    full 8-bit weights; VNNI accumulates in int32 and needs no such margin."""
    return (not cpu_has_vnni()) if setting is None else setting


def quant_type(name: str):
    from onnxruntime.quantization import QuantType

    return {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}[name]


class CalibrationReader:
    """ONNX Runtime's CalibrationDataReader over named arrays, in batches (the graph's inputs only)."""

    def __init__(self, inputs: dict[str, np.ndarray], input_names: list[str], batch_size: int = 8):
        from optimize.evaluate.harness import batches_of

        self.batches = [{k: b[k] for k in input_names} for b in batches_of(inputs, batch_size)]
        self.rewind()

    def get_next(self):
        return next(self._iter, None)

    def rewind(self):
        self._iter = iter(self.batches)

    def __iter__(self):  # GPTQ reads batches by iterating a copy of the reader
        return iter(self.batches)


def onnx_input_names(path: Path) -> list[str]:
    from engines.onnxruntime_runner import OrtRunner

    return OrtRunner(path).input_names
