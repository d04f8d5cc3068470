"""What kernels.c assumes of every value it is given, checked here before any of it reaches C.

kernels.c trusts its caller: it reads `dim` floats of each norm, `vocab_rows` rows of the embedding,
positions up to `context` of the KV cache, without a bound check in its loops (they are the hot
path). So everything it will read is checked here, once, at load time, and the comment above
`ng_new` in kernels.c lists the same items in the same order:

1. counts (layers, widths, heads, vocabulary, context, threads) are whole numbers, whatever GGUF type
   stores them, positive, and within bounds that keep every product the C side forms inside its
   types (`int` counts, `size_t` byte sizes): `count`, `hyperparameters`, `context_positions`,
   `thread_count`;
2. the shape arithmetic: heads divide the width into even heads, key/value heads divide heads,
   widths are whole 32-wide blocks, the rotary embedding covers whole heads: `hyperparameters`;
3. floats (rope.freq_base, the RMS epsilon) are finite and positive as the f32 the C side receives,
   the rotary base at least 1 (its frequencies then at most 1): `positive_float`;
4. every tensor it reads is there with the shape and type the header implies: the seven matrices of
   each layer (K-quants' rows whole super-blocks), token_embd and output as [width, vocabulary], the
   three norms as [width] and Qwen2's q, k and v biases as long as their rows, in F32 or F16 (finite
   values): `check_tensors`, `check_norm`, `check_bias`;
5. the file's layout: each tensor's data lies inside the file at an offset aligned to the file's
   general.alignment, no two overlapping (llama.cpp refuses both): `check_layout`;
6. block scales (and Q4_1's and Q5_1's offsets, the K-quants' super-block scales and mins) are finite
   f16 numbers: `check_scales`, one vectorized test a tensor while it is repacked (a NaN or Inf scale
   turns every logit NaN); Q4_0's and Q5_0's offsets (-8 and -16 x scale, formed in f16) too, where
   model.repacked forms them;
7. the KV cache (f16 unless f32 is asked for: `kv_bytes`) fits this machine's memory: `check_memory`.
Each refusal is a NativeModelError: one line naming the field or the tensor.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from engines.gguf import CarryError

# Architectures the kernels run: Llama (rotation of adjacent pairs, as GGUF stores its Q and K rows) and
# Qwen2 (biases on q, k and v; rotation of each head's halves, NEOX style). Each's keys are under its name.
ARCHITECTURES = ("llama", "qwen2")
NEOX = ("qwen2",)
BIASED = ("attn_q", "attn_k", "attn_v")  # Qwen2's biased matrices, in the order kernels.c adds them
KV_BYTES = {"f16": 2, "f32": 4}  # the KV cache's element: f16 halves what a token reads at long context
INT_MAX = 2**31 - 1
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 20  # width and feed-forward width: 3 x width (q|k|v rows) and 2 x ffn stay far inside int
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 20  # positions of the KV cache (the C side's int positions, its size_t cache)
DEFAULT_CONTEXT = 4096  # positions the KV cache holds unless told (f32: SmolLM2-135M, 190 MB)
MAX_THREADS = 1024
MATRIX_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
NORM_TYPES = ("F32", "F16")
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NORMS = ("attn_norm", "ffn_norm")
# Bytes a block of 32 takes, and where its f16 numbers sit in it (scale, then Q4_1's offset).
# K-quants: a super-block of 256 values, its f16 scale d (and Q4_K / Q5_K's dmin).
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip
SUPER_BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


class NativeModelError(CarryError):
    """The file cannot run in the native kernels as it is (one line naming the tensor or field)."""


@dataclass(frozen=True)
class Hyperparameters:
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context_length: int  # the model's own
    rope_base: float
    eps: float
    arch: str = "llama"

    @property
    def neox(self) -> bool:
        return self.arch in NEOX

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def vocab_rows(self) -> int:
        """The vocabulary padded to whole 16-row groups (kernels.c's vocab_rows)."""
        return self.vocab + (-self.vocab % 16)


def field(reader, key: str, default=None):
    found = reader.fields.get(key)
    if found is None:
        if default is None:
            raise NativeModelError(f"the GGUF file has no {key}")
        return default
    return found.contents()


def count(reader, key: str, default=None, upper: int = INT_MAX) -> int:
    """A header count: a whole number whatever type stores it (a FLOAT32 2.5 is refused, not read as 2),
    at most `upper`. Whether it may be 0 or negative is the caller's to say (naming what it breaks)."""
    value = field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise NativeModelError(f"the GGUF file's {key} is {str(value)[:40]!r}, not a number")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise NativeModelError(f"the GGUF file's {key} is {value!r}, not a whole number")
    if int(value) > upper:
        raise NativeModelError(f"the GGUF file's {key} is {int(value)}, above the native kernels' {upper}")
    return int(value)


def positive_float(reader, key: str, default=None, least: float = 0.0) -> float:
    """A header float as the f32 the C side receives: finite and above 0, or at least `least` where it
    is given (0, a negative, NaN or Inf, or one that rounds to 0 or overflows in f32, makes every
    logit NaN)."""
    value = field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise NativeModelError(f"the GGUF file's {key} is {str(value)[:40]!r}, not a number")
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = float(np.float32(value))
    if not (math.isfinite(as_f32) and as_f32 > 0):
        raise NativeModelError(f"the GGUF file's {key} is {value!r}; the kernels need a finite number above 0")
    if as_f32 < least:
        raise NativeModelError(
            f"the GGUF file's {key} is {value!r}; the kernels need a finite number of at least {least:g}"
        )
    return as_f32


def hyperparameters(reader) -> Hyperparameters:
    """The model's shape, refused in one line where the kernels cannot run it (items 1 to 3)."""
    arch = str(field(reader, "general.architecture", ""))  # every key is under its name
    if arch not in ARCHITECTURES:
        raise NativeModelError(f"the native GGUF kernels run {', '.join(ARCHITECTURES)}, not {arch!r}")
    heads = count(reader, f"{arch}.attention.head_count", upper=MAX_WIDTH)
    h = Hyperparameters(
        layers=count(reader, f"{arch}.block_count", upper=MAX_LAYERS),
        dim=count(reader, f"{arch}.embedding_length", upper=MAX_WIDTH),
        ffn=count(reader, f"{arch}.feed_forward_length", upper=MAX_WIDTH),
        heads=heads,
        kv_heads=count(reader, f"{arch}.attention.head_count_kv", default=heads, upper=MAX_WIDTH),
        vocab=vocabulary(reader),
        context_length=count(reader, f"{arch}.context_length", upper=2**63),
        # At least 1: each frequency base^(-2i/d) is then at most 1, so position x frequency stays finite.
        rope_base=positive_float(reader, f"{arch}.rope.freq_base", 10000.0, least=1.0),
        eps=positive_float(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        arch=arch,
    )
    if h.heads <= 0 or h.kv_heads <= 0 or h.dim <= 0 or h.dim % h.heads or h.heads % h.kv_heads or h.head_dim % 2:
        raise NativeModelError(
            f"the native GGUF kernels cannot run this file: {h.heads} heads and {h.kv_heads} key/value heads "
            f"do not divide width {h.dim} into heads of an even size"
        )
    problems = []
    layers = {
        int(t.name.split(".")[1])
        for t in reader.tensors
        if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()
    }
    if h.layers <= 0 or layers != set(range(h.layers)):
        problems.append(f"its header says {h.layers} layers, its tensors number {len(layers)}")
    if h.context_length <= 0:
        problems.append(f"its context length is {h.context_length}")
    if count(reader, f"{arch}.rope.dimension_count", default=h.head_dim) != h.head_dim:
        problems.append("its rotary embedding covers part of each head (the kernels rotate whole heads)")
    for width, name in ((h.dim, "width"), (h.ffn, "feed-forward width"), (h.kv_heads * h.head_dim, "key/value width")):
        if width <= 0 or width % 32:
            problems.append(f"its {name} {width} is not a whole number of 32-wide blocks")
    if str(field(reader, f"{arch}.rope.scaling.type", "none")) not in ("none", ""):
        problems.append("it scales its rotary embedding (rope.scaling), which the kernels do not")
    allowed = (
        {f"blk.{i}.{name}.bias" for i in range(max(h.layers, 0)) for name in BIASED} if h.arch == "qwen2" else set()
    )
    if any(
        t.name == "rope_freqs.weight" or (t.name.endswith(".bias") and t.name not in allowed) for t in reader.tensors
    ):
        problems.append("it has rotary frequency factors or biases, which the kernels do not apply")
    if problems:
        raise NativeModelError("the native GGUF kernels cannot run this file: " + "; ".join(problems))
    return h


def vocabulary(reader) -> int:
    """The vocabulary: token_embd.weight's row count, which must be a [width, vocabulary] matrix."""
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise NativeModelError("the native GGUF kernels cannot run this file: it has no token_embd.weight")
    shape = [int(n) for n in embedding.shape]
    if len(shape) != 2 or not 0 < shape[1] <= MAX_VOCAB:
        raise NativeModelError(
            f"token_embd.weight is {shape}, not a [width, vocabulary] matrix of at most {MAX_VOCAB} rows"
        )
    return shape[1]


def expected_tensors(h: Hyperparameters) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """{name: (shape as GGUF lists it, row length first; the types the kernels read it as)} of every
    tensor kernels.c reads (output.weight only where the file has its own head)."""
    kv = h.kv_heads * h.head_dim
    matrices = {"attn_q": (h.dim, h.dim), "attn_k": (h.dim, kv), "attn_v": (h.dim, kv), "attn_output": (h.dim, h.dim),
                "ffn_gate": (h.dim, h.ffn), "ffn_up": (h.dim, h.ffn), "ffn_down": (h.ffn, h.dim)}  # fmt: skip
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
        "token_embd.weight": ((h.dim, h.vocab), MATRIX_TYPES),
        "output.weight": ((h.dim, h.vocab), MATRIX_TYPES),
        "output_norm.weight": ((h.dim,), NORM_TYPES),
    }
    for layer in range(h.layers):
        out.update({f"blk.{layer}.{name}.weight": (shape, MATRIX_TYPES) for name, shape in matrices.items()})
        out.update({f"blk.{layer}.{name}.weight": ((h.dim,), NORM_TYPES) for name in LAYER_NORMS})
        if h.arch == "qwen2":  # q, k and v's biases, each as long as its matrix's rows
            out.update({f"blk.{layer}.{name}.bias": ((matrices[name][1],), NORM_TYPES) for name in BIASED})
    return out


def check_tensors(reader, h: Hyperparameters) -> None:
    """Item 4: every tensor the kernels read, with the shape and type the header implies."""
    tensors = {t.name: t for t in reader.tensors}
    for name, (shape, types) in expected_tensors(h).items():
        t = tensors.get(name)
        if t is None:
            if name == "output.weight":
                continue  # the head is the embedding (tied)
            raise NativeModelError(f"the GGUF file has no {name}")
        found = tuple(int(n) for n in t.shape)
        if found != shape:
            raise NativeModelError(f"{name} is {list(found)}, not {list(shape)} as the header says")
        if t.tensor_type.name not in types:
            raise NativeModelError(
                f"{name} is {t.tensor_type.name}; the native GGUF kernels read it as {' or '.join(types)}"
            )
        if found[0] % SUPER_BLOCK.get(t.tensor_type.name, 32):
            raise NativeModelError(f"{name}'s rows of {found[0]} are not whole {t.tensor_type.name} super-blocks")


def check_layout(reader) -> None:
    """Item 5: each tensor's data inside the file, aligned to general.alignment, none overlapping."""
    alignment, base, size = int(reader.alignment), int(reader.data_offset), len(reader.data)
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    for start, end, name in spans:
        if (start - base) % alignment:
            raise NativeModelError(
                f"{name}'s data offset {start - base} is not a multiple of the file's alignment {alignment}"
            )
        if end > size:
            raise NativeModelError(f"{name}'s data runs past the end of the file")
    for (_, end, before), (start, _, name) in zip(spans, spans[1:]):
        if start < end:
            raise NativeModelError(f"{name}'s data overlaps {before}'s")


def check_norm(name: str, values: np.ndarray, h: Hyperparameters) -> np.ndarray:
    """A norm's weights as the f32 vector the kernels read: `dim` finite values."""
    if values.shape != (h.dim,):
        raise NativeModelError(f"{name} holds {values.size} values, not the width {h.dim}")
    if not np.isfinite(values).all():
        raise NativeModelError(f"{name} holds a value that is not finite (NaN or Inf)")
    return values


def check_bias(name: str, values: np.ndarray) -> np.ndarray:
    """A bias as the f32 vector the kernels add (its length checked with the tensors): finite values."""
    values = values.astype(np.float32).reshape(-1)
    if not np.isfinite(values).all():
        raise NativeModelError(f"{name} holds a value that is not finite (NaN or Inf)")
    return values


def kv_bytes(kind: str) -> int:
    """Bytes of a KV cache element: "f16" (the default) or "f32"."""
    if kind not in KV_BYTES:
        raise NativeModelError(f"a KV cache of {str(kind)[:20]!r}: the native GGUF kernels keep f16 or f32")
    return KV_BYTES[kind]


def check_scales(name: str, kind: str, raw: np.ndarray) -> None:
    """Item 6: every f16 scale (and Q4_1 offset) of a tensor's blocks finite. `raw`: [rows, row bytes]."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[kind])
    for at in BLOCK_HALVES[kind]:
        halves = blocks[..., at : at + 2].copy().view(np.uint16)
        if ((halves & 0x7C00) == 0x7C00).any():  # f16 exponent all ones: Inf or NaN
            what = "offset" if at == 2 else "scale"
            raise NativeModelError(f"{name} has a {kind} block whose f16 {what} is NaN or Inf")


def check_all_scales(reader) -> None:
    """Item 6 over the whole file at once (the pipeline's engine stage, before the artifact is made)."""
    for t in reader.tensors:
        if t.tensor_type.name in BLOCK_BYTES:
            raw = np.asarray(t.data, dtype=np.uint8)
            check_scales(t.name, t.tensor_type.name, raw.reshape(-1, raw.shape[-1]))


def context_positions(requested, h: Hyperparameters) -> int:
    """Item 1 for the KV cache: `requested` (0: the model's own, at most DEFAULT_CONTEXT) a whole number
    0..MAX_CONTEXT, capped at the model's context length."""
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)):
        raise NativeModelError(f"a context of {str(requested)[:40]!r} positions is not a whole number")
    if not 0 <= requested <= MAX_CONTEXT:
        raise NativeModelError(f"a context of {requested} positions is outside 0..{MAX_CONTEXT} (0: the model's own)")
    return min(int(requested) or DEFAULT_CONTEXT, h.context_length)


def thread_count(requested: int) -> int:
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or not 1 <= requested <= MAX_THREADS:
        raise NativeModelError(f"{str(requested)[:40]} threads: the native GGUF kernels take 1..{MAX_THREADS}")
    return int(requested)


def check_memory(h: Hyperparameters, context: int, element: int = 2) -> None:
    """Item 7: the KV cache (keys and values, every layer, `element` bytes each) within this machine's
    memory; the C side zeroes all of it, so an allocation that only overcommit lets through would be
    killed, not refused."""
    cache = 2 * element * h.layers * (context + 7) // 8 * 8 * h.kv_heads * h.head_dim
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if cache > memory:
        raise NativeModelError(
            f"a KV cache of {context} positions needs {cache / 2**30:.1f} GiB, more than this machine's "
            f"{memory / 2**30:.1f} GiB (ask for a shorter context)"
        )


def checked(reader) -> Hyperparameters:
    """Items 1 to 5 (all but the scales, which repacking checks tensor by tensor): the hyperparameters."""
    h = hyperparameters(reader)
    check_tensors(reader, h)
    check_layout(reader)
    return h
