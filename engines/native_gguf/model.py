"""A GGUF file in the native kernels: its hyperparameters checked, its blocks repacked 16 rows to a
group (kernels.c gives the layout; the bytes per weight stay the file's), and one decoding step.

What it carries as it is: a Llama whose matrices are Q4_0, Q4_1 or Q8_0 (mixed freely) and whose
norms are F32 or F16. Anything else is named before a byte is repacked (`uncarried`, and contract.py:
every value kernels.c reads, checked before any of it reaches C).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from engines.hardware import usable_cores
from engines.native_gguf import build, contract
from engines.native_gguf.contract import (  # noqa: F401 (the module's interface: the pipeline reads them here)
    LAYER_MATRICES,
    Hyperparameters,
    NativeModelError,
    field,
    hyperparameters,
)
from engines.openvino.genai_gguf import GGUFTensor, named, open_reader, outside

ARCHITECTURES = ("llama",)
# GGUF types of matrices carried as they are, and what each becomes (the manifest's record).
CARRIED = {
    "Q4_0": "4-bit groups of 16 rows, the file's f16 scale, offset -8 x scale (exact)",
    "Q4_1": "4-bit groups of 16 rows, the file's f16 scale and offset (exact)",
    "Q8_0": "8-bit groups of 16 rows, the file's f16 scale (exact)",
}
KIND_4BIT, KIND_8BIT = 0, 1
GROUP = 16


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
    if kind == "Q4_0":  # d * (q - 8) is d * q + m with m = -8d, exact in f16 (a power of two)
        blocks = raw.reshape(raw.shape[0], -1, 18)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
        if np.abs(d).max(initial=0) * 8 > np.finfo(np.float16).max:
            raise NativeModelError(f"{t.name} has a Q4_0 scale whose offset -8 x scale overflows f16")
        offset = (d * -8).astype(np.float16).view(np.uint8)
        return KIND_4BIT, _groups_4bit(blocks[..., 2:], blocks[..., 0:2], offset)
    raise NativeModelError(f"{t.name} is {kind}; the native GGUF kernels carry {', '.join(CARRIED)}")


def _groups_4bit(qs: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] nibbles (ggml: element e < 16 in byte e's low nibble, e >= 16 in byte e-16's
    high one) and [rows, blocks, 2] f16 scales and offsets -> [groups, blocks, 320] bytes."""
    rows, blocks = qs.shape[:2]
    groups = rows // GROUP
    values = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [rows, blocks, 32], element order
    values = values.reshape(groups, GROUP, blocks, 4, 2, 4)  # group, lane, block, t, low/high, k
    packed = (values[..., 0, :] | (values[..., 1, :] << 4)).astype(np.uint8)
    packed = packed.transpose(0, 2, 3, 1, 4).reshape(groups, blocks, 256)
    lanes = [
        a.reshape(groups, GROUP, blocks, 2).transpose(0, 2, 1, 3).reshape(groups, blocks, 32) for a in (scale, offset)
    ]
    return np.ascontiguousarray(np.concatenate([packed, *lanes], axis=-1))


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
    lib.ng_new.argtypes = [i, i, i, i, i, i, i, f, f, i]
    lib.ng_layer.argtypes = [p, i, p, p, p, p, p]
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

    def __init__(self, path: str | Path, context: int = 0, threads: int = 0):
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
        contract.check_memory(h, self.context)
        self._keep: list[np.ndarray] = []  # the arrays the C side points into
        self.weight_bytes_per_token = 0  # every matrix a step reads (the embedding gives one row)
        self._lib = _library()
        rows = h.vocab_rows
        handle = self._lib.ng_new(
            h.layers, h.dim, h.ffn, h.heads, h.kv_heads, rows, self.context, h.rope_base, h.eps, self.threads
        )
        if not handle:
            raise NativeModelError(f"out of memory for a KV cache of {self.context} positions")
        self._model = handle
        for layer in range(h.layers):
            self._load_layer(tensors, layer)
        self._load_head(tensors)
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
