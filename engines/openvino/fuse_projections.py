"""Fuse the projections that read one input into one MatMul in an OpenVINO decoder IR: each layer's
q, k and v, and its gate and up, become one MatMul of their weights stacked along the output axis
and a VariadicSplit that hands each consumer its own part.

Why: the CPU plugin runs each compressed MatMul of a decode step as its own FullyConnected, and on a
135M-parameter model most of a step's time is spent per FullyConnected rather than per weight byte:
SmolLM2's INT8 IR spent 78% of a 10-11 ms step in 211 of them (35 us each). Seven per layer become
four, and the continuous-batching pipeline decoded one request 1.10-1.17x as fast (2-core Zen 4).
Hand-written: on this CPU the plugin ran each projection as its own FullyConnected (its profile
lists seven a layer), and optimum-intel exports them apart.

The weights are not changed, only placed side by side: every constant of a member's decompression
subgraph (NNCF's Convert, Subtract and Multiply of the weight, zero points and scales) is stacked
along its first axis, which is the output axis of a weight read transposed. The groups are found by
the graph (MatMuls reading one activation with a constant weight), and within a group the members
whose subgraphs are the same ops with constants of the same element types and the same shapes past
the first axis are fused: a layer whose q is INT8 and k INT4 keeps them apart, and LoRA correction's
adapters that read the same input are fused among themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

DECOMPRESSION = ("Convert", "Subtract", "Multiply", "Reshape")
# The exporter's names of the projections a fused MatMul stands for, and the name it gets.
NAMED = {
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"): "self_attn.qkv_proj",
    ("mlp.gate_proj", "mlp.up_proj"): "mlp.gate_up_proj",
}
SUFFIX = "/aten::linear/MatMul"


@dataclass
class Fused:
    groups: int = 0  # sets of two or more weight MatMuls that read one activation (q, k, v; gate, up)
    fused: int = 0  # of them fused into one MatMul (in part, where only some members' weights match)

    def record(self) -> dict:
        return {"groups": self.groups, "fused": self.fused}


def fuse_projections(model) -> Fused:
    """Fuse in place, in `model` (an ov.Model), every set of MatMuls that read the same activation
    with a constant weight read transposed, as far as their weights' subgraphs match; returns the
    counts. Found by the graph, not by names: IRs read from GGUF files name their MatMuls by number."""
    readers: dict[tuple, list] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul" or op.get_attributes().get("transpose_a"):
            continue
        if not op.get_attributes().get("transpose_b"):
            continue
        tree = _tree(op.input_value(1).get_node())
        if tree is not None:
            source = op.input_value(0)
            readers.setdefault((source.get_node().get_friendly_name(), source.get_index()), []).append((op, tree))
    result = Fused()
    for members in readers.values():
        if len(members) < 2:
            continue
        result.groups += 1
        alike: dict[tuple, list] = {}
        for op, tree in members:
            alike.setdefault(_signature(tree), []).append((op, tree))
        fused = [_fuse(same) for same in alike.values() if len(same) > 1]
        result.fused += any(fused)
    if result.fused:
        model.validate_nodes_and_infer_types()
    return result


def _fuse(members: list) -> bool:
    from openvino import opset13 as ops

    members, name = _named(members)
    nodes, trees = [m[0] for m in members], [m[1] for m in members]
    if any(n.input_value(0) != nodes[0].input_value(0) for n in nodes[1:]):  # grouped by name: make sure
        return False
    rows = [int(_rows(t)) for t in trees]
    weight = _stacked(trees, rows)
    if weight is None:
        return False
    matmul = ops.matmul(nodes[0].input_value(0), weight, False, True)
    matmul.set_friendly_name(name)
    split = ops.variadic_split(matmul, ops.constant(np.int64(-1)), ops.constant(np.array(rows, np.int64)))
    for index, node in enumerate(nodes):
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(split.output(index))
    return True


def _named(members: list) -> tuple[list, str]:
    """(the members in the exporter's order, the fused MatMul's name): layers.N.self_attn.qkv_proj
    (q, k, v) or layers.N.mlp.gate_up_proj (gate, up) where they are those projections, whatever
    order the graph lists them in; else as listed, their names joined."""
    by_name = {m[0].get_friendly_name(): m for m in members}
    for projections, fused in NAMED.items():
        match = re.fullmatch(r"(.*layers\.\d+)\.\w+\.\w+" + re.escape(SUFFIX), next(iter(by_name)))
        if not match:
            continue
        names = [f"{match[1]}.{p}{SUFFIX}" for p in projections]
        if sorted(names) == sorted(by_name):
            return [by_name[n] for n in names], f"{match[1]}.{fused}{SUFFIX}"
    return members, "+".join(by_name)


def _tree(node, depth: int = 0):
    """The weight input's subgraph as (node, [children]) down to its Constants; None when it reads
    anything else (an activation, an op outside NNCF's decompression)."""
    kind = node.get_type_name()
    if kind == "Constant":
        return (node, [])
    if depth > 6 or kind not in DECOMPRESSION:
        return None
    children = [_tree(value.get_node(), depth + 1) for value in node.input_values()]
    return None if any(c is None for c in children) else (node, children)


def _signature(tree) -> tuple:
    """The ops, and each constant's element type and shape past its first axis (a Reshape's target
    shape past its first entry): equal for members that can be stacked."""
    node, children = tree
    if node.get_type_name() == "Constant":
        shape = tuple(node.get_output_shape(0))
        return ("Constant", node.get_output_element_type(0).get_type_name(), shape[1:], len(shape))
    own: tuple = (node.get_type_name(), node.get_output_element_type(0).get_type_name())
    if node.get_type_name() in ("Subtract", "Multiply"):  # rebuilt with the default (numpy) broadcast
        own += (str(node.get_attributes().get("auto_broadcast", "numpy")).lower(),)
    if node.get_type_name() == "Reshape":
        target = children[1][0]
        if target.get_type_name() != "Constant":
            return ("unfusable",)
        own += (tuple(int(v) for v in target.get_data()[1:]),)
        children = children[:1]
    return own + tuple(_signature(c) for c in children)


def _concatenated(constants: list):
    """One constant of the members' stacked along the first axis. Sub-byte types (u4, i4) are read
    and written as their packed bytes: each row is whole bytes, so stacking rows is joining bytes."""
    import openvino as ov

    element = constants[0].get_output_element_type(0)
    shapes = [list(c.get_output_shape(0)) for c in constants]
    shape = [sum(s[0] for s in shapes), *shapes[0][1:]]
    if element.bitwidth >= 8:
        return ov.op.Constant(ov.Tensor(np.ascontiguousarray(np.concatenate([c.get_data() for c in constants]))))
    row_bits = int(np.prod(shape[1:])) * element.bitwidth
    if row_bits % 8:
        return None
    tensor = ov.Tensor(element, ov.Shape(shape))
    tensor.data[:] = np.concatenate([c.get_data().reshape(-1) for c in constants])
    return ov.op.Constant(tensor)


def _rows(tree) -> int:
    """The member's output rows: its weight's first dimension."""
    return tree[0].get_output_shape(0)[0]


def _stacked(trees: list, rows: list[int]):
    """The members' subgraph rebuilt once, every constant stacked along its first axis (a constant of
    one row broadcast alike must hold the same values in every member); None where one does not."""
    from openvino import opset13 as ops

    nodes = [t[0] for t in trees]
    kind = nodes[0].get_type_name()
    if kind == "Constant":
        shapes = [tuple(n.get_output_shape(0)) for n in nodes]
        if shapes[0] and all(shape[0] == r for shape, r in zip(shapes, rows)):
            return _concatenated(nodes)
        same = all(np.array_equal(nodes[0].get_data(), n.get_data()) for n in nodes[1:])
        return nodes[0] if same else None  # broadcast alike: shared
    if kind == "Reshape":
        data = _stacked([t[1][0] for t in trees], rows)
        target = nodes[0].input_value(1).get_node().get_data().copy()
        target[0] = sum(rows)
        special_zero = bool(nodes[0].get_attributes().get("special_zero", False))
        return None if data is None else ops.reshape(data, ops.constant(target), special_zero)
    inputs = [_stacked([t[1][i] for t in trees], rows) for i in range(len(trees[0][1]))]
    if any(i is None for i in inputs):
        return None
    if kind == "Convert":
        return ops.convert(inputs[0], nodes[0].get_output_element_type(0))
    return (ops.subtract if kind == "Subtract" else ops.multiply)(*inputs)
