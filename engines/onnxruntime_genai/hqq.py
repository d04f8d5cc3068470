"""HQQ (half-quadratic quantization) of an ONNX Runtime GenAI decoder's weights onto MatMulNBits, with
ONNX Runtime's own quantizer: a full-precision model.onnx (the builder's fp32 output) is rewritten in
place, the body at 4 bits (asymmetric, in blocks along the input channels) and the LM head at
`head_bits` (8: rounded to the nearest level, symmetric). HQQ fits each block's scale and zero point
by a proximal solver on the weights alone (no calibration data): closer than rounding to the nearest
level, for a slower build."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)
MODEL_FILE = "model.onnx"


class HQQError(RuntimeError):
    """The quantizer refused the model or the settings (one line)."""


def head_matmuls(graph) -> list[str]:
    """The LM head's MatMul (named /lm_head/MatMul by the builder)."""
    return [n.name for n in graph.node if n.op_type == "MatMul" and "lm_head" in n.name]


def quantize_hqq(model_dir: Path, block_size: int = 32, head_bits: int = 8, accuracy_level: int | None = None) -> dict:
    """Rewrite model_dir/model.onnx (external data in model.onnx.data) with HQQ MatMulNBits weights;
    returns {bits: MatMul count}."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if head_bits not in (4, 8) or block_size not in (16, 32, 64, 128, 256):
        raise HQQError(f"HQQ: head_bits {head_bits} (4 or 8), block_size {block_size} (16 to 256, a power of 2)")
    path = Path(model_dir) / MODEL_FILE
    model = onnx.load(str(path))
    matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    head = head_matmuls(model.graph)
    counts: dict[int, int] = {}
    # Two passes: ONNX Runtime's quantizer takes one bit width per call and quantizes every MatMul not
    # excluded, so the head's pass excludes the body, and the body's finds the head already quantized.
    # The 8-bit head is rounded to the nearest level (symmetric): the CPU MatMulNBits kernel refuses
    # 8-bit weights with HQQ's float zero points.
    passes = [(head_bits, [n for n in matmuls if n not in head]), (4, [])] if head and head_bits != 4 else [(4, [])]
    for bits, excluded in passes:
        hqq = bits == 4
        quantizer = MatMulNBitsQuantizer(
            model,
            bits=bits,
            block_size=block_size,
            is_symmetric=not hqq,
            accuracy_level=accuracy_level,
            nodes_to_exclude=excluded,
            algo_config=HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits) if hqq else None,
        )
        try:
            quantizer.process()
        except (NotImplementedError, ValueError, RuntimeError, AssertionError) as exc:
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise HQQError(f"HQQ {bits}-bit: {first}") from None
        model = quantizer.model.model
        before = sum(counts.values())
        counts[bits] = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits") - before
    left = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name in matmuls]
    if not counts.get(4):
        raise HQQError(f"HQQ quantized no MatMul to 4 bits ({len(left)} left at full precision)")
    data = path.with_name(MODEL_FILE + ".data")
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, location=data.name, size_threshold=1024)
    log.info(
        "HQQ: %s MatMuls at 4 bits, %s at %d bits, %d left",
        counts.get(4),
        counts.get(head_bits, 0),
        head_bits,
        len(left),
    )
    return counts
