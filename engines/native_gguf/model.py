"""A GGUF file in the native kernels: its hyperparameters checked, its blocks repacked 16 rows to a
group (kernels.c gives the layout; the bits per weight stay the file's: 4-, 5- and 6-bit values are
nibbles and bit planes, unpacked in registers), and one decoding step.

What it carries as it is: a Llama or a Qwen2 whose matrices are Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K
(mixed freely) and whose norms (and Qwen2's biases) are F32 or F16. Anything else is named before a
byte is repacked (`uncarried`, and contract.py: every value kernels.c reads, checked before any of it
reaches C).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from engines.gguf import GGUFTensor, named, open_reader, outside
from engines.hardware import usable_cores
from engines.native_gguf import build, contract
from engines.native_gguf.contract import (  # noqa: F401 (the module's interface: the pipeline reads them here)
    LAYER_MATRICES,
    Hyperparameters,
    NativeModelError,
    field,
    hyperparameters,
)

ARCHITECTURES = contract.ARCHITECTURES
# GGUF types of matrices carried as they are, and what each becomes (the manifest's record).
CARRIED = {
    "Q4_0": "4-bit groups of 16 rows, the file's f16 scale, offset -8 x scale (exact)",
    "Q4_1": "4-bit groups of 16 rows, the file's f16 scale and offset (exact)",
    "Q8_0": "8-bit groups of 16 rows, the file's f16 scale (exact)",
    "Q5_0": "5-bit groups of 16 rows (nibbles, fifth bits a plane), the file's f16 scale, offset -16 x scale (exact)",
    "Q5_1": "5-bit groups of 16 rows (nibbles, fifth bits a plane), the file's f16 scale and offset (exact)",
    "Q4_K": "4-bit groups of 16 rows, each sub-block's scale and min as f32 (exact)",
    "Q5_K": "5-bit groups of 16 rows (nibbles, fifth bits a plane), each sub-block's scale and min as f32 (exact)",
    "Q6_K": "6-bit groups of 16 rows (nibbles, bit planes), each 16-value sub-block's scale as f32 (exact)",
}
KIND_4BIT, KIND_8BIT, KIND_4BIT_K, KIND_6BIT_K, KIND_5BIT, KIND_5BIT_K = 0, 1, 2, 3, 4, 5
GROUP = 16
QK_K = 256


def uncarried(architecture: str, items: list[GGUFTensor]) -> str | None:
    """Why the file cannot be carried through, naming the tensors; None when every tensor can."""
    if architecture not in ARCHITECTURES:
        return f"the native GGUF kernels run {', '.join(ARCHITECTURES)}, not {architecture!r}"
    listed = named(outside(items, CARRIED))
    return (
        f"the native GGUF kernels carry {', '.join(CARRIED)} matrices, not these tensors' types: {listed}"
        if listed
        else None
    )


def repacked(t) -> tuple[int, np.ndarray]:
    """(kind, bytes) of a Q4_0 / Q4_1 / Q8_0 tensor in kernels.c's 16-row groups, its rows padded with
    zeros to a multiple of 16 (only a vocabulary can need it: every layer width is checked to be one)."""
    kind = t.tensor_type.name
    if kind not in CARRIED:
        raise NativeModelError(f"{t.name} is {kind}; the native GGUF kernels carry {', '.join(CARRIED)}")
    raw = np.asarray(t.data, dtype=np.uint8)
    contract.check_scales(t.name, kind, raw)
    rows = raw.shape[0]
    padded = -rows % GROUP
    if padded:
        raw = np.concatenate([raw, np.zeros((padded, raw.shape[1]), np.uint8)])
    if kind == "Q8_0":
        return KIND_8BIT, _groups_8bit(raw.reshape(raw.shape[0], -1, 34))
    if kind == "Q4_1":
        blocks = raw.reshape(raw.shape[0], -1, 20)
        return KIND_4BIT, _groups_4bit(blocks[..., 4:], blocks[..., 0:2], blocks[..., 2:4])
    if kind in ("Q5_0", "Q5_1"):
        blocks = raw.reshape(raw.shape[0], -1, contract.BLOCK_BYTES[kind])
        values, d, m = _q5(blocks, offsets=kind == "Q5_1")
        if kind == "Q5_0" and np.abs(d).max(initial=0) * 16 > np.finfo(np.float16).max:
            raise NativeModelError(f"{t.name} has a Q5_0 scale whose offset -16 x scale overflows f16")
        d16, m16 = (np.ascontiguousarray(a.astype(np.float16))[..., None].view(np.uint8) for a in (d, m))
        return KIND_5BIT, _groups_nibbles(values, d16, m16, extra=1)
    if kind in K_QUANTS:
        values, scale, offset = K_QUANTS[kind](raw.reshape(raw.shape[0], -1, contract.BLOCK_BYTES[kind]))
        if kind == "Q6_K":
            return KIND_6BIT_K, _groups_6bit_k(values, scale)
        d32, m32 = (np.ascontiguousarray(a, np.float32)[..., None].view(np.uint8) for a in (scale, offset))
        if kind == "Q4_K":
            return KIND_4BIT_K, _groups_nibbles(values, d32, m32, extra=0)
        return KIND_5BIT_K, _groups_nibbles(values, d32, m32, extra=1)
    if kind == "Q4_0":  # d * (q - 8) is d * q + m with m = -8d, exact in f16 (a power of two)
        blocks = raw.reshape(raw.shape[0], -1, 18)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
        if np.abs(d).max(initial=0) * 8 > np.finfo(np.float16).max:
            raise NativeModelError(f"{t.name} has a Q4_0 scale whose offset -8 x scale overflows f16")
        offset = (d * -8).astype(np.float16).view(np.uint8)
        return KIND_4BIT, _groups_4bit(blocks[..., 2:], blocks[..., 0:2], offset)
    raise NativeModelError(f"{t.name} is {kind}; the native GGUF kernels carry {', '.join(CARRIED)}")


def _q4_k(blocks: np.ndarray):
    """Q4_K super-blocks [rows, n, 144] (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles: chunk j's 32 bytes hold sub-block 2j in their low nibbles, 2j + 1 in their high ones) ->
    (values [rows, 8n, 32] 0..15, scales and offsets [rows, 8n] f32, exact: d x sc - dmin x m per value)."""
    d, dmin = (blocks[..., at : at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))
    sc, mn = _scales_and_mins(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 32)
    values = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*blocks.shape[:2], 8, 32)
    return _per_block(values), _per_block(d * sc), _per_block(-(dmin * mn))


def _q5_k(blocks: np.ndarray):
    """Q5_K super-blocks [rows, n, 176]: Q4_K's header, 32 bytes of fifth bits (bit 2j of byte l is
    sub-block 2j's value l's, bit 2j + 1 sub-block 2j + 1's), then Q4_K's nibbles."""
    d, dmin = (blocks[..., at : at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))
    sc, mn = _scales_and_mins(blocks[..., 4:16])
    qh = blocks[..., 16:48]
    qs = blocks[..., 48:176].reshape(*blocks.shape[:2], 4, 32)
    low = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*blocks.shape[:2], 8, 32)
    fifth = np.stack([(qh >> bit) & 1 for bit in range(8)], axis=-2)  # [rows, n, 8 sub-blocks, 32]
    return _per_block(low | (fifth << 4)), _per_block(d * sc), _per_block(-(dmin * mn))


def _q6_k(blocks: np.ndarray):
    """Q6_K super-blocks [rows, n, 210] (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales of
    16-value sub-blocks, f16 d), as unsigned 0..63 values with scale d x sc and offset -32 d x sc (exact)."""
    rows, n = blocks.shape[:2]
    ql = blocks[..., :128].reshape(rows, n, 2, 2, 32)  # half, first / second 32 bytes, l
    qh = blocks[..., 128:192].reshape(rows, n, 2, 32)
    parts = [
        (ql[..., 0, :] & 15) | (((qh >> 0) & 3) << 4),
        (ql[..., 1, :] & 15) | (((qh >> 2) & 3) << 4),
        (ql[..., 0, :] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[..., 1, :] >> 4) | (((qh >> 6) & 3) << 4),
    ]
    values = np.stack(parts, axis=-2).reshape(rows, n * 8, 32)  # element 128 half + 32 part + l
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, n, 16]
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)
    scale = (d * sc).reshape(rows, n * 8, 2)
    return values.astype(np.uint8), scale, -32 * scale


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (sub-blocks 0-3 in the low 6 bits of
    bytes 0-3 and 4-7; 4-7 in the nibbles of bytes 8-11, their top 2 bits in the top of bytes 0-7)."""
    q = packed.astype(np.uint8)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _per_block(a: np.ndarray) -> np.ndarray:
    """[rows, n super-blocks, 8, ...] -> [rows, 8n, ...]."""
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _q5(blocks: np.ndarray, offsets: bool):
    """Q5_0 [rows, n, 22] (f16 d, 32 fifth bits, 16 bytes of nibbles; x = d (q - 16)) or Q5_1 [rows, n, 24]
    (f16 d and m first; x = d q + m): values 0..31 (element e < 16 in byte e's low nibble, e >= 16 in
    byte e - 16's high one, its fifth bit bit e of the little-endian word), f32 scales and offsets."""
    start = 4 if offsets else 2
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0] if offsets else -16 * d
    bits = blocks[..., start : start + 4].copy().view("<u4")  # [rows, n, 1]
    qs = blocks[..., start + 4 : start + 20]
    fifth = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.concatenate([qs & 15, qs >> 4], axis=-1) | (fifth << 4), d, m


# K-quants (scales exact in f32 only: an f16 times a 6- or 8-bit integer): values, f32 scales and offsets a
# block of 32 (Q6_K: a half of one).
K_QUANTS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def _planes(values: np.ndarray, extra: int) -> list[np.ndarray]:
    """[groups, GROUP, blocks, 32] values -> `extra` bit planes [groups, blocks, 64]: plane p's byte 4i + k
    holds, in bit 2t + h, bit 4 + p of the value that nibble h of nibble byte 64t + 4i + k holds."""
    groups, _, blocks, _ = values.shape
    by_vector = values.reshape(groups, GROUP, blocks, 4, 2, 4).transpose(0, 2, 3, 4, 1, 5)  # g, b, t, h, i, k
    by_vector = by_vector.reshape(groups, blocks, 8, 64).astype(np.uint16)
    weights = (1 << np.arange(8, dtype=np.uint16))[:, None]
    return [(((by_vector >> (4 + p)) & 1) * weights).sum(axis=2).astype(np.uint8) for p in range(extra)]


def _lanes(a: np.ndarray, groups: int) -> np.ndarray:
    """[rows, blocks, w] bytes (each row's number) -> [groups, blocks, 16w]: a group-block's 16 rows' in order."""
    rows, blocks, width = a.shape
    return a.reshape(groups, GROUP, blocks, width).transpose(0, 2, 1, 3).reshape(groups, blocks, 16 * width)


def _group_values(values: np.ndarray, extra: int) -> np.ndarray:
    """[rows, blocks, 32] values (4 + extra bits) -> [groups, blocks, 256 + 64 extra]: the nibbles (byte
    64t + 4i + k holds row i's elements 8t + k low, 8t + 4 + k high), then the bit planes."""
    rows, blocks = values.shape[:2]
    groups = rows // GROUP
    values = values.astype(np.uint8).reshape(groups, GROUP, blocks, 32)
    split = (values & 15).reshape(groups, GROUP, blocks, 4, 2, 4)  # group, lane, block, t, low/high, k
    packed = (split[..., 0, :] | (split[..., 1, :] << 4)).astype(np.uint8)
    packed = packed.transpose(0, 2, 3, 1, 4).reshape(groups, blocks, 256)
    return np.concatenate([packed, *_planes(values, extra)], axis=-1)


def _groups_nibbles(values: np.ndarray, scale: np.ndarray, offset: np.ndarray, extra: int) -> np.ndarray:
    """[rows, blocks, 32] values of 4 + extra bits and [rows, blocks, w] scales and offsets (w = 2: f16, 4:
    f32 as bytes) -> [groups, blocks, 256 + 64 extra + 32w] bytes (kernels.c's 4- and 5-bit group-blocks)."""
    groups = values.shape[0] // GROUP
    lanes = [_lanes(a, groups) for a in (scale, offset)]
    return np.ascontiguousarray(np.concatenate([_group_values(values, extra), *lanes], axis=-1))


def _groups_6bit_k(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[rows, blocks, 32] values 0..63 and f32 scales per half [rows, blocks, 2] -> [groups, blocks, 512]
    bytes (kernels.c's 6-bit K group-block: the offset, -32 x scale, is the kernel's to form)."""
    rows, blocks = values.shape[:2]
    groups = rows // GROUP
    halves = np.ascontiguousarray(scale, np.float32).reshape(groups, GROUP, blocks, 2).transpose(0, 2, 3, 1)
    d = np.ascontiguousarray(halves).reshape(groups, blocks, 32).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([_group_values(values, 2), d], axis=-1))


def _groups_4bit(qs: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] nibbles (ggml: element e < 16 in byte e's low nibble, e >= 16 in byte e-16's
    high one) and [rows, blocks, 2] f16 scales and offsets as bytes -> [groups, blocks, 320] bytes."""
    return _groups_nibbles(np.concatenate([qs & 15, qs >> 4], axis=-1), scale, offset, extra=0)


def _groups_8bit(blocks: np.ndarray) -> np.ndarray:
    """[rows, blocks, 34] Q8_0 blocks (f16 scale, 32 int8) -> [groups, blocks, 544] bytes."""
    rows, count = blocks.shape[:2]
    groups = rows // GROUP
    values = blocks[..., 2:].reshape(groups, GROUP, count, 8, 4).transpose(0, 2, 3, 1, 4).reshape(groups, count, 512)
    scales = blocks[..., 0:2].reshape(groups, GROUP, count, 2).transpose(0, 2, 1, 3).reshape(groups, count, 32)
    return np.ascontiguousarray(np.concatenate([values, scales], axis=-1))


def _vector(t, h: Hyperparameters) -> np.ndarray:
    values = np.asarray(t.data).astype(np.float32).reshape(-1)
    return np.ascontiguousarray(contract.check_norm(t.name, values, h))


def _library() -> ctypes.CDLL:
    """The kernels, loaded only once their sealed build record verifies (build.load); the argument
    types are kernels.c's (every count an int: contract.py bounds each to fit)."""
    lib = build.load()
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.ng_new.restype = p
    lib.ng_new.argtypes = [i, i, i, i, i, i, i, f, f, i, i, i]
    lib.ng_layer.argtypes = [p, i, p, p, p, p, p]
    lib.ng_layer_bias.argtypes = [p, i, p]
    lib.ng_head.argtypes = [p, p, i, p, i, p]
    lib.ng_step.argtypes = [p, i, i, p]
    lib.ng_forward.argtypes = [p, p, i, i, p, i]
    lib.ng_max_batch.restype = i
    lib.ng_free.argtypes = [p]
    lib.ng_vnni.restype = i
    return lib


def kernel_path() -> str:
    """What the kernels compiled here multiply with, for the manifest."""
    if _library().ng_vnni():
        return "AVX-512 VNNI, activations at 16 bits per block of 32 (two 8-bit planes)"
    return "AVX2, activations at 15 bits per block of 32 (a 7-bit and an 8-bit plane)"


class NativeGGUF:
    """One sequence's decoder over `path`'s blocks: step(token, position) -> the next token's logits."""

    def __init__(self, path: str | Path, context: int = 0, threads: int = 0, kv_cache: str = "f16"):
        reader = open_reader(Path(path))
        arch = field(reader, "general.architecture", "")
        tensors = {t.name: t for t in reader.tensors}
        reason = uncarried(
            str(arch), [GGUFTensor(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors]
        )
        if reason:
            raise NativeModelError(reason)
        self.hyper = h = contract.checked(reader)  # everything kernels.c reads, but the scales (repacking's)
        self.context = contract.context_positions(context, h)
        self.threads = contract.thread_count(threads or usable_cores())
        self.kv_bytes = contract.kv_bytes(kv_cache)
        contract.check_memory(h, self.context, self.kv_bytes)
        self._keep: list[np.ndarray] = []  # the arrays the C side points into
        self.weight_bytes_per_token = 0  # every matrix a step reads (the embedding gives one row)
        self._lib = _library()
        rows = h.vocab_rows
        handle = self._lib.ng_new(
            h.layers, h.dim, h.ffn, h.heads, h.kv_heads, rows, self.context, h.rope_base, h.eps, self.threads,
            int(self.kv_bytes == 2), int(h.neox),
        )  # fmt: skip
        if not handle:
            raise NativeModelError(f"out of memory for a KV cache of {self.context} positions")
        self._model = handle
        from engines.file_pages import give_back_read_only

        for layer in range(h.layers):
            self._load_layer(tensors, layer)
            # The layer's file pages, copied into its repacked blocks: given back as the load goes, else
            # the whole file and its copy are resident at the end of it (7 GB for a 3.2 GB Q8_0 file).
            give_back_read_only(reader.data)
        self._load_head(tensors)
        give_back_read_only(reader.data)
        self.max_batch = int(self._lib.ng_max_batch())
        self._logits = np.zeros((self.max_batch, rows), np.float32)

    def _pointer(self, array: np.ndarray) -> int:
        self._keep.append(array)
        return array.ctypes.data

    def _load_layer(self, tensors: dict, layer: int) -> None:
        matrices = self._layer_matrices(tensors, layer)
        self.weight_bytes_per_token += sum(data.nbytes for _, _, data in matrices)
        n = len(matrices)
        kinds = (ctypes.c_int * n)(*[kind for kind, _, _ in matrices])
        rows = (ctypes.c_int * n)(*[count for _, count, _ in matrices])
        pointers = (ctypes.c_void_p * n)(*[self._pointer(data) for _, _, data in matrices])
        norms = [self._pointer(_vector(tensors[f"blk.{layer}.{n}.weight"], self.hyper)) for n in contract.LAYER_NORMS]
        self._lib.ng_layer(self._model, layer, *norms, kinds, rows, pointers)
        if self.hyper.arch == "qwen2":  # q, k and v each have a bias (contract.check_tensors)
            biases = [tensors[f"blk.{layer}.{name}.bias"] for name in contract.BIASED]
            fused = np.concatenate([contract.check_bias(b.name, np.asarray(b.data)) for b in biases])
            self._lib.ng_layer_bias(self._model, layer, self._pointer(np.ascontiguousarray(fused, np.float32)))

    @staticmethod
    def _layer_matrices(tensors: dict, layer: int) -> list[tuple[int, int, np.ndarray]]:
        """(kind, rows, repacked bytes) of q|k|v, out, gate|up and down, in the order ng_layer reads them.
        Parts of one kind are one matrix (one pass over the activations); parts of two are each their own."""
        parts = {name: repacked(tensors[f"blk.{layer}.{name}.weight"]) for name in LAYER_MATRICES}
        matrices = []
        for fused in (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",)):
            kinds = {parts[name][0] for name in fused}
            if len(kinds) == 1:
                data = np.concatenate([parts[name][1] for name in fused])
                matrices.append((kinds.pop(), data.shape[0] * GROUP, data))
            else:
                matrices += [(parts[name][0], parts[name][1].shape[0] * GROUP, parts[name][1]) for name in fused]
        return matrices

    def _load_head(self, tensors: dict) -> None:
        embedding_kind, embedding = repacked(tensors["token_embd.weight"])
        head_kind, head = (
            (embedding_kind, embedding) if "output.weight" not in tensors else repacked(tensors["output.weight"])
        )
        norm = self._pointer(_vector(tensors["output_norm.weight"], self.hyper))
        self.weight_bytes_per_token += head.nbytes
        self._lib.ng_head(self._model, norm, embedding_kind, self._pointer(embedding), head_kind, self._pointer(head))

    def step(self, token: int, position: int) -> np.ndarray:
        """The logits after `token` at `position` (positions 0 .. position - 1 already stepped). The
        array is overwritten by the next call."""
        return self.forward([token], position)[-1]

    def forward(self, tokens, position: int, every: bool = True) -> np.ndarray:
        """Logits after each of `tokens` (at positions `position` ..., the cache holding the positions
        before): [len(tokens), vocab], or the last token's alone [1, vocab] unless `every`. Read in
        passes of max_batch tokens; the array is overwritten by the next call unless copied."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        if tokens.size == 0:
            raise ValueError("no tokens to run")
        if tokens.min() < 0 or tokens.max() >= self.hyper.vocab:
            bad = int(tokens[(tokens < 0) | (tokens >= self.hyper.vocab)][0])
            raise ValueError(f"token {bad} is outside the vocabulary (0..{self.hyper.vocab - 1})")
        if not 0 <= position or position + tokens.size > self.context:
            raise ValueError(
                f"positions {position}..{position + tokens.size - 1} are past the KV cache's {self.context}"
            )
        out = []
        for start in range(0, tokens.size, self.max_batch):
            chunk = tokens[start : start + self.max_batch]
            last = start + chunk.size == tokens.size
            keep = every or last
            logits = self._logits.ctypes.data if keep else None  # a pass whose logits nobody reads skips the head
            self._lib.ng_forward(self._model, chunk.ctypes.data, chunk.size, position + start, logits, int(every))
            if keep:
                rows = self._logits[: chunk.size if every else 1, : self.hyper.vocab]
                out.append(rows.copy() if every and not last else rows)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def close(self) -> None:
        if getattr(self, "_model", None):
            self._lib.ng_free(self._model)
            self._model = None

    def __del__(self):
        self.close()
