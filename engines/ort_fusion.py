"""Fusing an exported ONNX graph into ONNX Runtime's contrib kernels (Attention with packed QKV,
SkipLayerNormalization, BiasGelu, RotaryEmbedding...) with onnxscript's ORT rewrite rules."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def fuse_for_onnxruntime(path: Path) -> dict[str, int]:
    """Rewrite `path` in place with ONNX Runtime's fused kernels; returns how many of each fusion
    applied. The export check that follows compares the fused graph with PyTorch."""
    import onnx_ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    graph = onnx_ir.load(str(path))
    fused, counts = optimize_for_ort(graph)
    onnx_ir.save(fused, str(path))
    applied = {name: int(n) for name, n in counts.items() if n}
    log.info("ONNX Runtime fusions: %s", ", ".join(f"{k} x{v}" for k, v in applied.items()) or "none applied")
    return applied
