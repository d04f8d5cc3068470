"""ONNX Runtime GenAI from a GGUF file's own blocks: the model builder's decoder (built from the file
dequantized), each MatMulNBits weight then replaced by the file's blocks for that matrix, copied
bit for bit, and a summary of what each GGUF tensor type became.

The block formats map onto MatMulNBits (w = (q - zero point) * scale per block along K):
- Q4_0 (w = d * (q - 8)): bits 4, scale d, uint8 zero point 8. Exact.
- Q4_1 (w = d * q + m): bits 4, scale d, uint8 zero point 0, and m carried as a second term: the
  activations summed per block of 32 times m (a small f32 MatMul added to the output), so
  x . w = d * (x . q) + m * sum(x). Exact to f32 summation order. (MatMulNBits takes the zero
  point -m/d as a float instead, but ORT 1.32's CPU kernel then dequantizes the whole matrix on
  every call: 18x slower than the uint8 path on a 576x1536 matrix.) With INT8 activations
  (accuracy_level 4) the zero point is each block's nearest integer to -m/d and the offset what is
  left (w = d * (q - z) + (m + z * d)): on SmolLM2's Q4_1 file +0.4% perplexity over the dequantized
  file, where zero point 0 lets the activations' rounding meet the uncentred 0..15.
  Or (offset_form int8_grid) as 8-bit blocks with no offset term: w = (d / k) * (k * q + c - Z) for
  the largest whole k (16 where the block's offset allows, as it does for every block of a file whose
  m is its block's minimum) that keeps k * q + c and the zero point Z within 0..255: each weight within
  d / (2k) of the file's (1/32 of a step at k = 16), twice the bytes a token of the 4-bit blocks, and
  no extra nodes, where the offset term is a MatMul and an Add a matrix that ONNX Runtime dispatches
  at about 5 us each: on SmolLM2's Q4_1 file +0.1% perplexity (+0.4% centred), and level to 1.18x
  the decode speed depending on the hour.
- Q8_0 (w = d * q, q int8): bits 8, q + 128 stored as uint8, zero point 128. Exact; ORT's CPU
  kernel has a fast 8-bit path only with INT8 activations (accuracy_level 4).
- Q4_K (per 256 values an f16 d and dmin, per sub-block of 32 a 6-bit scale sc and min m:
  w = d * sc * q - dmin * m): Q4_1's form per block of 32, bits 4, f32 scale d * sc, uint8 zero point
  0, and -dmin * m carried as block sums times it. The f32 products are the ones gguf's dequantize
  makes, so exact to f32 summation order.
- Q6_K (per 256 values an f16 d, per sub-block of 16 an int8 scale sc, 6-bit q: w = d * sc * (q - 32)):
  bits 8, block 16, q + 96 stored as uint8, zero point 128, f32 scale d * sc. Exact; 8 bits, so the
  same CPU speed as Q8_0.
The nibble order differs (GGUF's Q4_0 / Q4_1: value j low and j + 16 high in byte j; Q4_K: in each
64 values, 32 low nibbles then 32 high; MatMulNBits: values 2i and 2i + 1 in byte i), so 4-bit values
are unpacked and repacked; no value changes. Blocks of 32 fused beside blocks of 16 (Q8_0 with Q6_K)
are written as pairs of blocks of 16, each with the block's scale (exact). Llama's Q/K rows,
permuted by llama.cpp for its rotary layout, are put back in the Hugging Face order the builder's
graph expects (whole rows move: exact). Q, K and V are fused by the builder into one qkv_proj: their
blocks are concatenated along N. One MatMulNBits holds one bit width, so where a layer's Q, K and V
are of two (Q4_K_M files: V Q6_K beside Q and K Q4_K) builder_options asks the builder for
separate q_proj, k_proj and v_proj (fuse_qkv=false), each carried at its own width. Gate and up are
fused the same way (fuse_mlp_gate_up) where a layer holds them at one width.
The embedding stays as the builder makes it from the dequantized file (an f32 Gather: the file's
values, not its blocks); the LM head (output, or the tied token_embd) becomes a MatMulNBits of the
file's blocks where lm_head_carried says (4-bit types always; Q8_0 and Q6_K with INT8 activations),
else stays the builder's f32 MatMul.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from engines.gguf import CarryError, GGUFTensor, named, open_reader, outside
from engines.onnxruntime_genai.build import OFFSET_SCOPE

log = logging.getLogger(__name__)

# Checked exact against the dequantized file. Qwen3 is not listed: on a tiny Qwen3 read from a GGUF
# file the builder's own f32 graph (nothing carried) was 0.48 off transformers' log-likelihoods.
ARCHITECTURES = ("llama", "qwen2")
BLOCK = 32  # the builder's MatMulNBits block (its option block_size=32); Q6_K's become 16
# GGUF types of matrices carried as blocks, and what each becomes in the ONNX model.
CARRIED = {
    "Q4_0": "MatMulNBits bits 4, block 32, f32 scale d, uint8 zero point 8 (exact)",
    "Q4_1": "MatMulNBits bits 4, block 32, f32 scale d, uint8 zero point 0, + block sums x f32 m (exact to f32)",
    "Q8_0": "MatMulNBits bits 8, block 32, f32 scale d, uint8 zero point 128 (exact)",
    "Q4_K": "MatMulNBits bits 4, block 32, f32 scale d*sc, uint8 zero point 0, + block sums x f32 -dmin*m"
    " (exact to f32)",
    "Q6_K": "MatMulNBits bits 8, block 16, f32 scale d*sc, uint8 zero point 128 (exact)",
}
# With INT8 activations (accuracy_level 4) the offset types sit on their nearest zero points (_centred).
CENTRED = {
    kind: CARRIED[kind].replace("uint8 zero point 0", "uint8 zero point round(-offset / scale) per block")
    for kind in ("Q4_1", "Q4_K")
}
# offset_form int8_grid: the offset types as 8-bit blocks on a finer zero-point grid (_on_grid).
GRID = {
    kind: "MatMulNBits bits 8, block 32, f32 scale d/k, uint8 zero point on a grid k times finer than the"
    " file's step (k = 16 where the offset fits), no offset term (each weight within d/(2k) of the file's)"
    for kind in ("Q4_1", "Q4_K")
}
OFFSET_FORMS = ("block_sums", "int8_grid")
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q6_K": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}  # one GGUF block's bytes
VECTOR_TYPES = ("F32", "F16")  # norms and biases: the builder's f32 copies of the file's values
NOT_CARRIED = "f32, dequantized from the file by the builder (the file's values, not its blocks)"
# The builder's MatMulNBits node (under /model/layers.N/) -> the GGUF matrices it holds, in N order.
NODE_TENSORS = {
    "attn/qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "attn/q_proj": ("attn_q",),
    "attn/k_proj": ("attn_k",),
    "attn/v_proj": ("attn_v",),
    "attn/o_proj": ("attn_output",),
    "mlp/gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp/gate_proj": ("ffn_gate",),
    "mlp/up_proj": ("ffn_up",),
    "mlp/down_proj": ("ffn_down",),
}
# The builder leaves embedding and LM head f32 (its int4 of them would change values); the LM head may
# then become the file's blocks.
LM_HEAD = "/lm_head/MatMul"
BUILDER_OPTIONS = ["shared_embeddings=false", f"nodes_to_exclude={LM_HEAD}"]
QKV = ("attn_q", "attn_k", "attn_v")
GATE_UP = ("ffn_gate", "ffn_up")
# Gate and up read the same input; the builder fuses them on request into one MatMulNBits and a Split
# (fuse_mlp_gate_up), as it fuses Q, K and V by default: one dispatch and one activation quantization a
# layer fewer, on SmolLM2's Q4_1 file (INT8 activations, the 8-bit grid) 1.02-1.13x the decode speed
# in one alternated set.


def builder_options(items: list[GGUFTensor]) -> list[str]:
    """The builder's options for this file: Q, K and V fused, and gate and up, except where one
    layer's are of two bit widths (Q4_K_M files mix them), which no one MatMulNBits holds."""
    mixed = _mixed_width_groups(items)
    options = list(BUILDER_OPTIONS)
    if QKV in mixed:
        options.append("fuse_qkv=false")
    if GATE_UP not in mixed:
        options.append("fuse_mlp_gate_up=true")
    return options


def _mixed_width_groups(items: list[GGUFTensor]) -> set[tuple[str, ...]]:
    """The fusable groups (QKV, GATE_UP) that some layer holds at two bit widths."""
    widths: dict[tuple[str, tuple[str, ...]], set[int]] = {}
    for t in items:
        layer, _, part = t.name.removesuffix(".weight").rpartition(".")
        group = next((g for g in (QKV, GATE_UP) if part in g), None)
        if layer.startswith("blk.") and group and t.type in BITS:
            widths.setdefault((layer, group), set()).add(BITS[t.type])
    return {group for (_, group), bits in widths.items() if len(bits) > 1}


def uncarried(architecture: str, items: list[GGUFTensor]) -> str | None:
    """Why the file cannot be carried as blocks, naming the tensors; None when every layer matrix can."""
    if architecture not in ARCHITECTURES:
        return f"the GGUF carry onto MatMulNBits maps {', '.join(ARCHITECTURES)}, not {architecture!r}"
    listed = named(outside(items, CARRIED, VECTOR_TYPES, lambda t: t.name.startswith("blk.")))
    return f"MatMulNBits has no exact form of these tensors' types: {listed}" if listed else None


def became(
    items: list[GGUFTensor],
    accuracy_level: int,
    head_accuracy_level: int | None = None,
    offset_form: str = "block_sums",
) -> dict[str, str]:
    """{gguf type: what it became}: layer matrices of carried types as blocks (the offset types in
    offset_form), and the LM head where lm_head_carried says (at head_accuracy_level, if given); the
    rest (the embedding, types with no exact form) f32 from the dequantized file, named where a type
    has both."""
    head_level = accuracy_level if head_accuracy_level is None else head_accuracy_level
    names = {t.name for t in items}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    blocks: dict[str, list[str]] = {}
    f32: dict[str, list[str]] = {}
    for t in items:
        if _carried(t) or (t.name == head and lm_head_carried(t.type, head_level)):
            blocks.setdefault(t.type, []).append(t.name)
            if t.name == "token_embd.weight":  # tied: the LM head carried, the embedding's Gather f32
                f32.setdefault(t.type, []).append("token_embd.weight (as the embedding)")
        else:
            f32.setdefault(t.type, []).append(t.name)
    forms = {**CARRIED, **CENTRED} if accuracy_level == 4 else dict(CARRIED)
    if offset_form == "int8_grid":
        forms.update(GRID)
    out: dict[str, str] = {}
    for kind in dict.fromkeys(t.type for t in items):
        if kind not in blocks:
            out[kind] = NOT_CARRIED
        elif kind not in f32:
            out[kind] = forms[kind]
        else:
            out[kind] = f"{forms[kind]}; {', '.join(f32[kind])}: {NOT_CARRIED}"
    return out


def _carried(t: GGUFTensor) -> bool:
    return t.name.startswith("blk.") and len(t.shape) >= 2 and t.type in CARRIED


def carry_blocks(
    gguf_path: Path,
    onnx_path: Path,
    accuracy_level: int,
    head_accuracy_level: int | None = None,
    offset_form: str = "block_sums",
    grid: dict[int, int] | None = None,
) -> dict[str, int]:
    """Replace every layer MatMulNBits weight of the builder's model at onnx_path by the file's blocks
    (in place; its external data rewritten); returns {gguf type: matrices carried}. The LM head runs at
    head_accuracy_level where given: 4 (INT8 activations) carries an 8-bit head's blocks while the
    layers keep f32 activations. Blocks with an offset (Q4_1, Q4_K) keep it as block sums times it
    (offset_form block_sums), or become 8-bit blocks on a finer zero-point grid (int8_grid; `grid`,
    where given, is counted up: {sub-steps k: blocks})."""
    if offset_form not in OFFSET_FORMS:
        raise CarryError(f"offset_form {offset_form!r}: use one of {', '.join(OFFSET_FORMS)}")
    import onnx
    from onnx import helper

    reader = open_reader(gguf_path)
    arch, heads = _architecture(reader)
    blocks = {t.name.removesuffix(".weight"): t for t in reader.tensors}
    model = onnx.load(str(onnx_path))
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    carried: dict[str, int] = {}
    extra: list[tuple[int, list]] = []
    block_sums: dict[tuple[str, int], str] = {}  # an input's block sums, once for the matrices it feeds
    head_level = accuracy_level if head_accuracy_level is None else head_accuracy_level
    for index, node in enumerate(graph.node):
        level = accuracy_level
        if node.name == LM_HEAD and node.op_type == "MatMul":
            head = blocks.get("output") or blocks["token_embd"]  # tied: the embedding's blocks
            level = head_level
            if not lm_head_carried(head.tensor_type.name, level):
                continue
            weights = _as_matmul_nbits(head, None)
            rows, n_blocks = weights["scales"].shape
            shape = {"K": n_blocks * weights["block"], "N": rows, "block_size": weights["block"]}
            node.op_type, node.domain = "MatMulNBits", "com.microsoft"
            node.attribute.extend(helper.make_attribute(k, v) for k, v in shape.items())
            items = [head]
        elif node.op_type == "MatMulNBits":
            items, weights = _layer_matrices(node, blocks, arch, heads)
        else:
            continue
        if offset_form == "int8_grid" and weights["offset"].any():
            weights = _on_grid(weights, node.name, grid)
        elif level == 4 and weights["offset"].any():
            weights = _centred(weights)
        _replace(node, initializers, graph, weights, level)
        if weights["offset"].any():
            extra.append((index, _offset_nodes(node, graph, weights["offset"], weights["block"], block_sums)))
        for t in items:
            carried[t.tensor_type.name] = carried.get(t.tensor_type.name, 0) + 1
    for index, nodes in reversed(extra):  # after their MatMulNBits, so the graph stays in order
        for offset, new in enumerate(nodes, start=1):
            graph.node.insert(index + offset, new)
    _save(model, onnx_path)
    return carried


def lm_head_carried(kind: str, accuracy_level: int) -> bool:
    """Whether the LM head becomes the file's blocks: 4-bit types always; 8-bit ones (Q8_0, Q6_K)
    only with INT8 activations (the CPU kernel's 8-bit path with f32 activations is slower than the
    f32 MatMul)."""
    return BITS.get(kind) == 4 or (BITS.get(kind) == 8 and accuracy_level == 4)


def _layer_matrices(node, blocks: dict, arch: str, heads: dict[str, int]) -> tuple[list, dict]:
    """(the GGUF tensors a builder MatMulNBits node holds, their MatMulNBits arrays concatenated along N)."""
    parts = _gguf_parts(node.name)
    if parts is None:
        raise CarryError(f"the builder's node {node.name} holds no GGUF matrix this carry knows")
    layer, names = parts
    items = [blocks[f"blk.{layer}.{n}"] for n in names]
    weights = [_as_matmul_nbits(t, heads.get(n) if arch == "llama" else None) for t, n in zip(items, names)]
    bits = {w["bits"] for w in weights}
    if len(bits) > 1:
        listed = ", ".join(f"{t.name} ({t.tensor_type.name})" for t in items)
        raise CarryError(f"{node.name} fuses {listed}: one MatMulNBits holds one bit width")
    block = min(w["block"] for w in weights)
    weights = [_reblocked(w, block) for w in weights]
    fused = {key: np.concatenate([w[key] for w in weights]) for key in ("B", "scales", "zero", "offset")}
    return items, {**fused, "bits": bits.pop(), "block": block}


def _reblocked(weights: dict, block: int) -> dict:
    """The same matrix in blocks of `block` (a divisor of its own): each block split, its scale, zero
    point and offset repeated (exact; values are stored in K order, so B only changes shape)."""
    if weights["block"] == block:
        return weights
    factor = weights["block"] // block
    rows = len(weights["B"])
    repeated = {key: np.repeat(weights[key], factor, axis=1) for key in ("scales", "zero", "offset")}
    B = weights["B"].reshape(rows, -1, block * weights["bits"] // 8)
    return {**weights, **repeated, "B": B, "block": block}


def _architecture(reader) -> tuple[str, dict[str, int]]:
    """(general.architecture, {attn_q: query heads, attn_k: key-value heads})."""
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field else ""
    heads = {}
    for name, key in (("attn_q", "head_count"), ("attn_k", "head_count_kv")):
        f = reader.fields.get(f"{arch}.attention.{key}")
        if f is not None:
            heads[name] = int(f.parts[f.data[0]][0])
    return arch, heads


def _gguf_parts(node_name: str) -> tuple[int, tuple[str, ...]] | None:
    """/model/layers.3/attn/qkv_proj/MatMul_Q4 -> (3, (attn_q, attn_k, attn_v))."""
    import re

    match = re.fullmatch(r"/model/layers\.(\d+)/(\w+/\w+)/MatMul(_Q\d)?", node_name)
    if not match or match.group(2) not in NODE_TENSORS:
        return None
    return int(match.group(1)), NODE_TENSORS[match.group(2)]


def _as_matmul_nbits(t, permuted_heads: int | None) -> dict:
    """One GGUF matrix as MatMulNBits arrays: bits, block, B [N, blocks, blob], scales and uint8 zero
    points [N, blocks], offset [N, blocks] (added as block sums x offset: Q4_1's m, Q4_K's -dmin*m;
    0 otherwise), rows in Hugging Face order."""
    kind = t.tensor_type.name
    if kind not in CARRIED:
        raise CarryError(f"GGUF tensor {t.name} ({kind}): MatMulNBits has no exact form of it")
    rows = int(np.prod(t.shape[1:]))
    data = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)
    if permuted_heads:
        data = data[_unpermuted(rows, permuted_heads)]
    blocks = data.reshape(rows, -1, BLOCK_BYTES[kind])
    if kind == "Q4_K":
        return _q4_k(blocks)
    if kind == "Q6_K":
        return _q6_k(blocks)
    scales = _f16(blocks[..., 0:2])
    offset = np.zeros_like(scales)
    if kind == "Q8_0":
        q = (blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _arrays(8, BLOCK, q, scales, 128, offset)
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # GGUF: j low, j + 16 high
    if kind == "Q4_1":
        offset = _f16(blocks[..., 2:4])
    return _arrays(4, BLOCK, _packed_4bit(values), scales, 8 if kind == "Q4_0" else 0, offset)


def _q4_k(blocks: np.ndarray) -> dict:
    """Q4_K [rows, super-blocks, 144] as Q4_1's form per sub-block of 32: scale d * sc, offset
    -dmin * m, both the f32 products gguf.quants.Q4_K.dequantize_blocks makes."""
    from gguf.quants import Q4_K

    rows, supers = blocks.shape[:2]
    flat = blocks.reshape(-1, 144)
    sc, m = Q4_K.get_scale_min(flat[:, 4:16].copy())  # the 6-bit scales and mins, [blocks, 8]
    scales = (_f16(flat[:, 0:2])[:, None] * sc.astype(np.float32)).reshape(rows, supers * 8)
    offset = -(_f16(flat[:, 2:4])[:, None] * m.astype(np.float32)).reshape(rows, supers * 8)
    qs = flat[:, 16:].reshape(-1, 4, 1, 32)  # each 64 values: 32 low nibbles, then 32 high
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, supers * 8, 32)
    return _arrays(4, 32, _packed_4bit(values), scales, 0, offset)


def _q6_k(blocks: np.ndarray) -> dict:
    """Q6_K [rows, super-blocks, 210] (128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales, f16 d) as 8-bit blocks of 16: q - 32 + 128 with zero point 128, scale d * sc in f32 (the
    product gguf.quants.Q6_K.dequantize_blocks makes)."""
    rows, supers = blocks.shape[:2]
    flat = blocks.reshape(-1, 210)
    low = flat[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = flat[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (low & 0x0F).reshape(-1, 8, 32) | ((high & 0x03).reshape(-1, 8, 32) << 4)  # 0..63, value q - 32
    sc = flat[:, 192:208].view(np.int8).astype(np.float32)
    scales = (_f16(flat[:, 208:210])[:, None] * sc).reshape(rows, supers * 16)
    B = (q + 96).astype(np.uint8).reshape(rows, supers * 16, 16)
    return _arrays(8, 16, B, scales, 128, np.zeros_like(scales))


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes a value [..., 2] -> their f16 as f32 [..., 1 dropped]."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _packed_4bit(values: np.ndarray) -> np.ndarray:
    """4-bit values [..., block] in K order -> MatMulNBits' bytes: value 2i low, 2i + 1 high."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def _arrays(bits: int, block: int, B: np.ndarray, scales: np.ndarray, zero: int, offset: np.ndarray) -> dict:
    zeros = np.full(scales.shape, zero, np.uint8)
    return {"bits": bits, "block": block, "B": B, "scales": scales, "zero": zeros, "offset": offset}


def _centred(weights: dict) -> dict:
    """Q4_1's form (q in 0..15, zero point 0, an offset m per block) rebased on the nearest integer
    zero point z = round(-m / d): w = d * (q - z) + (m + z * d), the same weights to f32 rounding.
    Why: with INT8 activations the kernel multiplies the rounded activations x' by (q - z) while the
    offset term sums the exact ones, so its error is (x' - x) . d(q - z); with z = 0 that is the
    uncentred q (about 7.5 on average), with the nearest z it is the weight itself less a residual of
    at most d / 2 a block, as llama.cpp's own INT8 dot product with Q4_1 errs."""
    scales, offset = weights["scales"], weights["offset"]
    ratio = np.divide(-offset, scales, out=np.zeros_like(offset), where=scales != 0)
    zero = np.clip(np.rint(ratio), 0, 15).astype(np.uint8)
    return {**weights, "zero": zero, "offset": (offset + zero.astype(np.float32) * scales).astype(np.float32)}


def _on_grid(weights: dict, name: str, grid: dict[int, int] | None = None) -> dict:
    """4-bit blocks with an offset (w = d * (q - z) + offset) as 8-bit blocks with none:
    w ~ (d / k) * (k * q + c - Z), Z = round(k * R) + c where R = z - offset / d, for each block the
    largest whole k in 1..16 with k * q + c (c = max(0, -round(k * R)), so the zero point is not
    negative) and Z within 0..255. Each weight moves at most d / (2k): 1/32 of the file's step where
    k is 16, which it is for every block whose offset lies within the block's own range (Q4_1's m is
    the block's minimum). A block of scale 0 holds one value, the offset: scale offset, values 1, zero
    point 0 (exact). Why 8 bits: MatMulNBits' zero point is an integer, and 16 steps of a 4-bit block
    leave no room for a fraction of one. A block whose offset lies beyond even k = 1 (more than about
    240 steps from its values) is refused, naming the matrix."""
    B, d = weights["B"], weights["scales"]
    q = np.stack([B & 0x0F, B >> 4], axis=-1).reshape(*B.shape[:-1], -1).astype(np.int32)
    flat = d == 0
    ratio = np.divide(weights["offset"], d, out=np.zeros_like(d), where=~flat)
    R = weights["zero"].astype(np.float64) - ratio.astype(np.float64)  # a flat block's: its zero point, k 16
    k = np.zeros(d.shape, np.int32)
    for sub in range(1, 17):  # the largest that fits wins
        Z = np.rint(sub * R)
        k[(Z <= 255) & (-Z <= 255 - 15 * sub)] = sub
    if (k == 0).any():
        raise CarryError(
            f"{name}: {int((k == 0).sum())} block(s) with an offset beyond the 8-bit grid's reach;"
            " use offset_form=block_sums"
        )
    Z = np.rint(k * R).astype(np.int32)
    Z[flat] = 0
    c = np.maximum(0, -Z)
    values = np.where(flat[..., None], 1, k[..., None] * q + c[..., None]).astype(np.uint8)
    scales = np.where(flat, weights["offset"], d / k).astype(np.float32)
    if grid is not None:
        for sub, blocks in zip(*np.unique(k, return_counts=True)):
            grid[int(sub)] = grid.get(int(sub), 0) + int(blocks)
    zero = (Z + c).astype(np.uint8)
    return {**weights, "bits": 8, "B": values, "scales": scales, "zero": zero, "offset": np.zeros_like(d)}


def _unpermuted(rows: int, heads: int) -> np.ndarray:
    """The file's row of each Hugging Face row of Llama's Q/K (llama.cpp interleaves each head's
    rotary halves; transformers' GGUF loader undoes it the same way)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _replace(node, initializers: dict, graph, fused: dict, accuracy_level: int) -> None:
    """The node's B, scales and zero points become the file's (its block size the file's too)."""
    from onnx import helper, numpy_helper

    n_rows, n_blocks = fused["scales"].shape
    bits, block = fused["bits"], fused["block"]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attributes["N"] != n_rows or attributes["K"] != n_blocks * block:
        raise CarryError(
            f"{node.name}: the builder's matrix is {attributes['N']}x{attributes['K']}, the file's "
            f"{n_rows}x{n_blocks * block}"
        )
    zero = fused["zero"]
    if bits == 4:  # two blocks' zero points a byte, each row padded to whole bytes
        zero = np.pad(zero, ((0, 0), (0, n_blocks % 2)))
        zero = (zero[:, 0::2] | (zero[:, 1::2] << 4)).astype(np.uint8)
    stem = node.input[1].removesuffix("_Q4").removesuffix("_Q8")
    names = [stem + "_gguf", f"{stem}_gguf_scales", f"{stem}_gguf_zero_points"]
    for name, array in zip(names, (fused["B"], fused["scales"], zero)):
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
    for name in node.input[1:]:
        if name in initializers:
            graph.initializer.remove(initializers.pop(name))
    node.input[:] = [node.input[0], *names]
    del node.attribute[:]
    attributes.update(bits=bits, block_size=block, accuracy_level=accuracy_level)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attributes.items())


def _offset_nodes(node, graph, offset: np.ndarray, block: int, block_sums: dict[tuple[str, int], str]) -> list:
    """y = MatMulNBits(x) + ReduceSum(x in blocks) @ offset^T: Q4_1's m, Q4_K's -dmin*m, exact. The
    block sums of an input feeding several matrices (gate and up) are computed once per block size."""
    from onnx import helper, numpy_helper

    n_rows, n_blocks = offset.shape
    x, y = node.input[0], node.output[0]
    product = f"{y}_blocks"
    node.output[0] = product
    prefix = node.name.rsplit("/", 1)[0] + OFFSET_SCOPE.rstrip("/")
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(offset.T), f"{prefix}/offsets"))
    nodes = []
    if (x, block) not in block_sums:
        block_sums[x, block] = f"{prefix}/sums"
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.array([0, 0, n_blocks, block], np.int64), f"{prefix}/block_shape"),
                numpy_helper.from_array(np.array([-1], np.int64), f"{prefix}/last_axis"),
            ]
        )
        nodes += [
            helper.make_node("Reshape", [x, f"{prefix}/block_shape"], [f"{prefix}/blocks"], name=f"{prefix}/Reshape"),
            helper.make_node(
                "ReduceSum",
                [f"{prefix}/blocks", f"{prefix}/last_axis"],
                [block_sums[x, block]],
                keepdims=0,
                name=f"{prefix}/ReduceSum",
            ),
        ]
    sums = block_sums[x, block]
    return [
        *nodes,
        helper.make_node("MatMul", [sums, f"{prefix}/offsets"], [f"{prefix}/out"], name=f"{prefix}/MatMul"),
        helper.make_node("Add", [product, f"{prefix}/out"], [y], name=f"{prefix}/Add"),
    ]


def _save(model, onnx_path: Path) -> None:
    """Write the model and its weights anew (onnx appends to an existing external-data file)."""
    import onnx

    data = onnx_path.with_name(onnx_path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(onnx_path), save_as_external_data=True, location=data.name, size_threshold=1024)
