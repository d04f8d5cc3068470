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


def pack_attention_qkv(source: Path, out: Path) -> tuple[Path, int]:
    """Give each fused Attention one packed QKV weight, so ONNX Runtime's quantizer can turn it into
    QAttention. Returns (graph, how many Attention nodes were packed); (source, 0) when none can be.

    onnxscript's fusion feeds Attention a Concat of the three projection weights (or, when constant
    folding merged them, one initializer) and sets qkv_hidden_sizes; the quantizer only quantizes an
    initializer weight and skips an Attention with qkv_hidden_sizes, so a quarter of a BERT layer's
    weight MatMuls stayed FP32. Equal Q/K/V sizes are
    the attribute's default, so dropping it changes nothing. QAttention has no additive attention-bias
    input, so the padding mask moves to mask_index as the raw [batch, sequence] attention_mask (int32),
    a form both Attention and QAttention read; the packed FP32 graph computes the same outputs."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    graph = model.graph
    if "attention_mask" not in {i.name for i in graph.input}:
        return source, 0
    weights = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    mask = "attention_mask_int32"
    packed = 0
    for node in graph.node:
        if node.op_type != "Attention" or len(node.input) < 2:
            continue
        concat = producer.get(node.input[1])
        if concat is not None and concat.op_type == "Concat" and all(i in weights for i in concat.input):
            axis = next(a.i for a in concat.attribute if a.name == "axis")
            stacked = np.concatenate([numpy_helper.to_array(weights[i]) for i in concat.input], axis=axis)
            graph.initializer.append(numpy_helper.from_array(stacked, f"{node.name or node.output[0]}_qkv_weight"))
            node.input[1] = graph.initializer[-1].name
        elif node.input[1] not in weights:  # a weight computed at run time: nothing to quantize
            continue
        sizes = [a for a in node.attribute if a.name == "qkv_hidden_sizes"]
        if sizes and len(set(sizes[0].ints)) == 1:
            node.attribute.remove(sizes[0])
        inputs = list(node.input)[:3] + [""] * max(0, 3 - len(node.input))
        del node.input[:]
        node.input.extend(inputs + [mask])
        packed += 1
    if not packed:
        return source, 0
    graph.node.insert(0, onnx.helper.make_node("Cast", ["attention_mask"], [mask], to=onnx.TensorProto.INT32))
    onnx.save(model, str(out))  # the Concats left unused are dropped by ONNX Runtime when it loads
    log.info("packed the QKV weights of %d Attention nodes", packed)
    return out, packed
