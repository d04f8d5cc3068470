"""How fast this CPU runs ONNX Runtime's INT8 GEMM against its FP32 GEMM, measured, not assumed.

On AVX2 without VNNI the u8*s8 products go through vpmaddubsw + vpmaddwd and run at about the FP32
kernel's speed; VNNI (vpdpbusd) and AMX make INT8 several times faster. Whether INT8 can pay off
on the machine at hand is this one ratio, so reports that involve INT8 carry it.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

# A transformer FFN projection at sequence length 128 (MiniLM: hidden 384, FFN 1536).
ROWS, K, N = 128, 384, 1536


def _matmul_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="gemm")],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, N])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@functools.lru_cache(maxsize=4)
def int8_gemm_speedup(threads: int = 0) -> dict:
    """{'fp32_ms', 'int8_ms', 'speedup'} for one [128, 384] x [384, 1536] GEMM, INT8 weights with
    activations quantized at run time (what dynamic INT8 runs), timed in alternation after warm-up."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from engines.hardware import cpu_has_vnni
    from engines.onnxruntime.runner import OrtRunner
    from optimize.evaluate.benchmark import measure

    with tempfile.TemporaryDirectory(prefix="optimize-kernels-") as tmp:
        fp32 = _matmul_model(Path(tmp) / "fp32.onnx")
        int8 = Path(tmp) / "int8.onnx"
        quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8, per_channel=True, reduce_range=not cpu_has_vnni())
        runners: dict[str, Any] = {"fp32": OrtRunner(fp32, threads=threads), "int8": OrtRunner(int8, threads=threads)}
        batch = {"x": np.random.default_rng(1).standard_normal((ROWS, K)).astype(np.float32)}
        stats = measure(runners, [batch], ROWS, warmup=20, repeats=200, budget_s=1.5, min_repeats=50)
    fp32_ms, int8_ms = stats["fp32"]["p50_ms"], stats["int8"]["p50_ms"]
    return {
        "shape": [ROWS, K, N],
        "fp32_ms": fp32_ms,
        "int8_ms": int8_ms,
        "speedup": fp32_ms / int8_ms,
        "other_cpu_share": stats["other_cpu_share"],
    }


def describe_int8(result: dict) -> str:
    """One line for a report: what INT8 buys on this CPU."""
    verdict = (
        "INT8 kernels here are no faster than FP32"
        if result["speedup"] < 1.15
        else "INT8 kernels here are faster than FP32"
    )
    return f"{verdict}: INT8 GEMM {result['speedup']:.2f}x FP32 ({result['int8_ms']:.3f} vs {result['fp32_ms']:.3f} ms)"
