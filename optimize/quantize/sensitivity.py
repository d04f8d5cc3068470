"""Sensitivity fallback: which quantized nodes to keep in FP32, ranked by the error quantizing each
adds to its own output, until the real quantized model reaches a calibration fidelity target.

Each step quantizes the whole model again and scores it, so on a deep model the nodes go back in
groups (NODES_PER_STEP_FROM: one node a step up to that many quantizable nodes, MiniLM's 36 among
them), and in a race the search stops at its time box (optimize/deadline.py) with the best it has
found, leaving the rest of the build's budget to quantize and write it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import numpy as np

from optimize.quantize.common import Fidelity

log = logging.getLogger(__name__)
NODES_PER_STEP_FROM = 48  # quantizable nodes per node kept FP32 at each step (at least one a step)
TIME_BOX_SHARE = 0.7  # of the build's budget; the rest quantizes the chosen nodes once more and writes it


def _weighted_matmuls(graph, op_types: list[str], excluded: list[str]) -> list[tuple[str, str, str, bool]]:
    """(node name, activation input, weight initializer, weight transposed) of each quantizable node."""
    weights = {i.name for i in graph.initializer}
    found = []
    for node in graph.node:
        if node.op_type not in op_types or node.name in excluded or len(node.input) < 2:
            continue
        if node.input[1] in weights:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            found.append((node.name, node.input[0], node.input[1], trans_b))
    return found


def _simulated_error(
    x: np.ndarray, w: np.ndarray, per_channel: bool, reduce_range: bool, x_range: Optional[tuple[float, float]] = None
) -> float:
    """Relative error of x @ w when x is quantized to uint8, per tensor, asymmetric, and w to symmetric
    int8 (per output column when per_channel). x's range is its own min/max, as ONNX Runtime's
    DynamicQuantizeLinear computes it, unless `x_range` gives the calibrated range of a static model."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    lo, hi = x_range if x_range is not None else (float(x.min()), float(x.max()))
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    x_scale = (hi - lo) / 255 or 1.0
    x_zero = np.round(-lo / x_scale)
    xq = (np.clip(np.round(x / x_scale) + x_zero, 0, 255) - x_zero) * x_scale
    qmax = 63 if reduce_range else 127
    w_max = np.abs(w).max(axis=0, keepdims=True) if per_channel else np.abs(w).max()
    w_scale = np.where(w_max > 0, w_max / qmax, 1.0)
    wq = np.clip(np.round(w / w_scale), -qmax, qmax) * w_scale
    exact = x @ w
    return float(np.linalg.norm(xq @ wq - exact)) / max(float(np.linalg.norm(exact)), 1e-30)


def _conv_error(
    x: np.ndarray, w: np.ndarray, per_channel: bool, reduce_range: bool, x_range: Optional[tuple[float, float]] = None
) -> float:
    """A Conv's ranking score: the relative errors of quantizing its input (uint8, per tensor) and
    its weight (int8, per output channel when per_channel), combined as independent noise. A proxy:
    the convolution itself is not simulated, which would take an im2col of every activation."""
    x = x.astype(np.float64)
    lo, hi = x_range if x_range is not None else (float(x.min()), float(x.max()))
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    x_scale = (hi - lo) / 255 or 1.0
    x_zero = np.round(-lo / x_scale)
    xq = (np.clip(np.round(x / x_scale) + x_zero, 0, 255) - x_zero) * x_scale
    w = w.reshape(len(w), -1).astype(np.float64)
    qmax = 63 if reduce_range else 127
    w_max = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max()
    w_scale = np.where(w_max > 0, w_max / qmax, 1.0)
    wq = np.clip(np.round(w / w_scale), -qmax, qmax) * w_scale
    x_error = np.linalg.norm(xq - x) / max(float(np.linalg.norm(x)), 1e-30)
    w_error = np.linalg.norm(wq - w) / max(float(np.linalg.norm(w)), 1e-30)
    return float(np.hypot(x_error, w_error))


def _rank_by_simulated_error(onnx_path: Path, inputs: dict, cfg, reduce_range: bool) -> list[str]:
    """One FP32 run records every quantizable node's input; nodes are ranked by the relative error
    that quantizing them alone adds to their own output (largest first). A static method's config
    gives `activation_ranges` (tensor -> calibrated (low, high)): those ranges, clipping included,
    are what its activations are quantized with."""
    import onnx
    from onnx import numpy_helper

    from engines.onnxruntime.runner import OrtRunner

    model = onnx.load(str(onnx_path))
    nodes = _weighted_matmuls(model.graph, cfg.op_types, cfg.nodes_to_exclude)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    for activation in dict.fromkeys(a for _, a, _, _ in nodes):
        if activation not in outputs:
            model.graph.output.append(onnx.helper.make_tensor_value_info(activation, onnx.TensorProto.FLOAT, None))
    probe = onnx_path.with_name("activations.onnx")
    onnx.save(model, str(probe))
    activations = OrtRunner(probe)(inputs)
    probe.unlink()
    ranges = getattr(cfg, "activation_ranges", None) or {}
    errors = {}
    convs = {n.name for n in model.graph.node if n.op_type == "Conv"}
    for name, activation, weight, trans_b in nodes:
        w = weights[weight].T if trans_b else weights[weight]
        simulate = _conv_error if name in convs else _simulated_error
        errors[name] = simulate(activations[activation], w, cfg.per_channel, reduce_range, ranges.get(activation))
    return sorted(errors, key=lambda name: errors[name], reverse=True)


def sensitivity_fallback(model, cfg, ctx, quantize, reduce_range: bool, fidelity: Fidelity) -> tuple[list[str], float]:
    """Keep the nodes with the largest simulated quantization error in FP32, a step at a time (one
    node, or a group on a deep model: step_size), until the real quantized model reaches the
    calibration fidelity target, max_fp32_nodes is reached, or the build's time box runs out (then
    the best set scored so far, said in the log).

    fidelity(reference outputs, quantized outputs) -> the score the target is compared with: the
    caller's (common.task_fidelity), so the search knows no task."""
    from engines.onnxruntime.runner import OrtRunner
    from optimize import deadline

    inputs = ctx.calibration_inputs(cfg.sensitivity_samples)
    reference = OrtRunner(model.onnx_path, threads=ctx.threads)(inputs)

    def score(path: Path) -> float:
        return fidelity(reference, OrtRunner(path, threads=ctx.threads)(inputs))

    best = score(quantize([]))
    if best >= cfg.fallback_min_cosine or cfg.max_fp32_nodes == 0:
        return [], best
    ranked = _rank_by_simulated_error(model.onnx_path, inputs, cfg, reduce_range)
    step = step_size(len(ranked))
    fp32: list[str] = []
    scored = [(best, fp32)]
    for end in range(step, min(cfg.max_fp32_nodes, len(ranked)) + step, step):
        if deadline.past(TIME_BOX_SHARE):
            best, fp32 = max(scored, key=lambda pair: pair[0])
            log.warning(
                "sensitivity fallback stopped at its time box (%.0f%% of the build budget): the best found "
                "so far ships, %d FP32 nodes, calibration min cosine %.5f",
                100 * TIME_BOX_SHARE,
                len(fp32),
                best,
            )
            return fp32, best
        fp32 = ranked[: min(end, cfg.max_fp32_nodes)]
        best = score(quantize(fp32))
        scored.append((best, fp32))
        log.debug("fallback: %d FP32 nodes, calibration min cosine %.5f", len(fp32), best)
        if best >= cfg.fallback_min_cosine:
            break
    return fp32, best


def step_size(quantizable: int) -> int:
    """Nodes kept FP32 per step of the search: one, or a group on a deep model."""
    return max(1, -(-quantizable // NODES_PER_STEP_FROM))
