"""One tensor's bytes in a GGUF type. The 32-value types without an importance matrix through the
`gguf` package's numpy quantizer (llama.cpp's reference rounding); the K-quants, and every type
given an importance matrix, through libgguf (llama.cpp's C quantizers, the importance-weighted
searches included)."""

from __future__ import annotations

from typing import Any

import numpy as np

from optimize.export.gguf import ExportError

NUMPY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def encode(data: np.ndarray, kind: str, imatrix: np.ndarray | None = None) -> tuple[np.ndarray, Any]:
    """(stored array, raw GGML type or None) for GGUFWriter.add_tensor."""
    import gguf

    rows = np.ascontiguousarray(data, dtype=np.float32)
    if kind == "F32":
        return rows, None
    if kind == "F16":
        return rows.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[kind]
    if imatrix is None and kind in NUMPY_TYPES:
        return gguf.quants.quantize(rows, qtype), qtype
    return k_quantized(rows, kind, imatrix), qtype


def k_quantized(rows: np.ndarray, kind: str, imatrix: np.ndarray | None) -> np.ndarray:
    try:
        import libgguf
    except ImportError:
        raise ExportError(f"GGUF type {kind} needs the libgguf package: pip install 'optimize[llm]'") from None
    weights = None
    if imatrix is not None:
        weights = np.ascontiguousarray(imatrix, dtype=np.float32)
        if weights.shape != (rows.shape[-1],) or not np.isfinite(weights).all():
            raise ExportError(f"the importance matrix for a {rows.shape} tensor has shape {weights.shape}")
    return libgguf.quantize_rows(rows, libgguf.GGMLQuantizationType[kind], weights)
