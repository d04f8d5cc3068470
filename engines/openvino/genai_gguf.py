"""OpenVINO GenAI from a GGUF file as it is: the stateful IR that OpenVINO GenAI's own GGUF reader
builds (Llama, Qwen2, Qwen3), its 4- and 8-bit blocks kept, with the mappings that reader rounds made
exact again, and a summary of what each GGUF tensor type became.

The reader (openvino.genai src/cpp/src/gguf_utils) keeps every block of 32 (Q6_K: 16) as u4/u8 values
with an f16 scale and a u4/u8 zero point. That holds Q4_0 (zero point 8), Q8_0 (128) and F16 exactly,
but rounds two things: Q4_1's and Q4_K's zero point (-min / scale, a fraction) to an integer, and the
K-quants' scale (super-block scale x 6/8-bit sub-block scale) to f16. The installed reader has no
option that keeps them (`enable_save_ov_model` only writes the IR it built), so the IR it saves is
patched here: for those tensors the zero point and scale become f32 constants computed from the file's
own bytes, so (q - zp) * scale is d * q + m, the value llama.cpp and the dequantized baseline use, to
f32 rounding. The u4/u8 values are not touched. Tensor types the reader does not read (Q5_0, Q5_1,
Q2_K, Q3_K, Q5_K, IQ*, F32 or BF16 matrices) are named by `uncarried` before anything is built.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from engines import gguf as gguf_tensors
from engines.gguf import CarryError, GGUFTensor, named, open_reader, outside
from engines.gguf import tensors as tensors  # what uncarried() and type_summary() take, read from the file
from engines.openvino.genai_build import IR_FILE, set_activation_quantization

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# GGUF types of matrices the reader keeps as blocks, and what each becomes in the IR.
CARRIED = {
    "Q4_0": "u4, block 32, f16 scale, zero point 8 (exact)",
    "Q4_1": "u4, block 32, f16 scale, f32 zero point -m/d (exact to f32)",
    "Q8_0": "u8, block 32, f16 scale, zero point 128 (exact)",
    "Q4_K": "u4, block 32, f32 scale d*sc, f32 zero point dmin*m/(d*sc) (exact to f32)",
    "Q6_K": "u8, block 16, f32 scale d*sc, zero point 32 (exact to f32)",
    "F16": "f16 (exact)",
}
# Types whose IR constants the reader rounds, patched here.
PATCHED = ("Q4_1", "Q4_K", "Q6_K")


def uncarried(architecture: str, items: list[GGUFTensor]) -> str | None:
    """Why the file cannot be carried through, naming the tensors; None when every tensor can."""
    if architecture not in ARCHITECTURES:
        return f"OpenVINO GenAI's GGUF reader builds {', '.join(ARCHITECTURES)}, not {architecture!r}"
    listed = named(outside(items, CARRIED))
    return f"OpenVINO GenAI's GGUF reader does not read these tensors' types: {listed}" if listed else None


def type_summary(items: list[GGUFTensor]) -> dict:
    """The manifest's record of the weights as in the source, and what each type became in this IR."""
    return gguf_tensors.type_summary(items, CARRIED)


def build_from_gguf(gguf_path: Path, out_dir: Path, dynamic_quantization_group_size: int = 0) -> tuple[dict, dict]:
    """out_dir holds openvino_model.xml/.bin built by OpenVINO GenAI's GGUF reader from the file, the
    rounded constants made exact and the projections that read one input fused (each layer's q, k, v;
    gate, up: engines/openvino/fuse_projections.py); returns ({gguf type: patched tensor count}, the
    fusion's counts). The reader writes the IR beside the file it reads, so it reads a link to the
    file inside a scratch folder.

    The CPU plugin's dynamic quantization (activations to INT8 in groups, its default for 4/8-bit
    weights) is set in the IR's runtime options, where every runner that compiles it reads it: 0 keeps
    activations in f32, so the IR computes what the dequantized model does."""
    import openvino as ov
    import openvino_genai

    from engines.openvino.fuse_projections import fuse_projections

    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / ".gguf_reader"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    link = work / "model.gguf"
    os.symlink(Path(gguf_path).resolve(), link)
    try:
        try:  # the pipeline is built only for the IR its reader saves
            openvino_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
        except RuntimeError as exc:
            raise CarryError(
                f"OpenVINO GenAI's GGUF reader refused the file ({str(exc).splitlines()[0][:200]})"
            ) from None
        model = ov.Core().read_model(str(work / IR_FILE))
        patched = patch_exact(model, Path(gguf_path))
        fused = fuse_projections(model).record()
        set_activation_quantization(model, dynamic_quantization_group_size)
        ov.save_model(model, str(out_dir / IR_FILE), compress_to_fp16=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return patched, fused


# ---------------------------------------------------------------- making the rounded constants exact


def patch_exact(model, gguf_path: Path) -> dict:
    """Replace the rounded zero points and scales of Q4_1, Q4_K and Q6_K tensors by f32 ones from the
    file. Each IR decompression subgraph is found by its f16 scale constant, computed here from the
    file as the reader computes it (rows in the file's order, or un-permuted for Llama's Q/K)."""
    import gguf

    reader = open_reader(gguf_path)
    heads = _head_counts(reader)
    subgraphs = _decompressions(model)
    patched: dict[str, int] = {}
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        if kind not in PATCHED or len(t.shape) < 2:
            continue
        rows = int(np.prod(t.shape[1:]))
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)
        reader_scale, scale, zero = _exact_constants(kind, blocks)
        if zero is not None and np.any(np.isnan(zero)):  # blocks of scale 0 with an offset (_zero_point)
            lost = int(np.isnan(zero).sum())
            log.warning("GGUF tensor %s (%s): %d blocks of scale 0 with an offset become 0", t.name, kind, lost)
            zero = np.nan_to_num(zero, nan=0.0)
        found = None
        for order in _row_orders(rows, heads):
            key = _key(reader_scale[order])
            if key in subgraphs:
                found = subgraphs.pop(key), order
                break
        if found is None:
            raise CarryError(f"GGUF tensor {t.name} ({kind}): no weight of the IR the reader built has its scales")
        (multiply, subtract, weight_convert), order = found
        _replace(multiply, subtract, weight_convert, scale[order], zero[order] if zero is not None else None)
        patched[kind] = patched.get(kind, 0) + 1
    model.validate_nodes_and_infer_types()
    return patched


def _exact_constants(kind: str, blocks: np.ndarray):
    """(the reader's f16 scale, exact f32 scale, exact f32 zero point or None), each [rows, groups]."""
    import gguf.quants as q

    rows = len(blocks)
    if kind == "Q4_1":
        q41 = blocks.reshape(rows, -1, 20)
        d = q41[..., 0:2].copy().view(np.float16)[..., 0]
        m = q41[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        d32 = d.astype(np.float32)
        return d, d32, _zero_point(-m, d32)
    if kind == "Q4_K":
        b = blocks.reshape(-1, 144)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = q.Q4_K.get_scale_min(b[:, 4:16].copy())
        scale = (d * sc.astype(np.float32)).reshape(rows, -1)
        offset = (dmin * mn.astype(np.float32)).reshape(rows, -1)  # x = scale * q - offset
        return scale.astype(np.float16), scale, _zero_point(offset, scale)
    # Q6_K: 128 bytes low bits, 64 high bits, 16 int8 sub-block scales, f16 d
    b = blocks.reshape(-1, 210)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    scale = (d * sc).reshape(rows, -1)
    return scale.astype(np.float16), scale, None


def _zero_point(offset: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """offset / scale, the zero point (q - zp) * scale needs. A block of scale 0 is a constant offset,
    which no zero point gives: NaN when its offset is not 0 (patch_exact says so and writes 0: its
    weights become 0, not the offset), else 0."""
    safe = np.where(scale != 0, scale, 1)
    zero = np.where(scale != 0, offset / safe, np.where(offset == 0, 0, np.nan))
    return zero.astype(np.float32)


def _head_counts(reader) -> tuple[int, ...]:
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field else ""
    counts = []
    for key in (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"):
        f = reader.fields.get(key)
        if f is not None:
            counts.append(int(f.parts[f.data[0]][0]))
    return tuple(dict.fromkeys(counts))


def _row_orders(rows: int, heads: tuple[int, ...]):
    """The file's row order, then Llama's Q/K un-permutation for each head count (what the reader and
    transformers both apply to llama.cpp's rotary layout)."""
    index = np.arange(rows)
    yield index
    for n in heads:
        if n and rows % (2 * n) == 0:
            yield index.reshape(n, rows // n // 2, 2).swapaxes(1, 2).reshape(rows)


def _key(scale_f16: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(scale_f16, dtype=np.float16).tobytes()).hexdigest()


def _decompressions(model) -> dict:
    """{key of the f16 scale: (Multiply, Subtract, weight Convert)} for every Convert(u4/u8) ->
    Subtract(zero point) -> Multiply(scale) weight subgraph the reader built."""
    out: dict[str, tuple] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Multiply":
            continue
        subtract, scale = (op.input_value(i).get_node() for i in (0, 1))
        if subtract.get_type_name() != "Subtract" or scale.get_type_name() != "Constant":
            continue
        convert = subtract.input_value(0).get_node()
        if convert.get_type_name() != "Convert":
            continue
        values = scale.get_data()
        if values.dtype != np.float16:
            continue
        out.setdefault(_key(values.reshape(values.shape[0], -1)), (op, subtract, convert))
    return out


def _replace(multiply, subtract, weight_convert, scale: np.ndarray, zero: np.ndarray | None) -> None:
    """(f32(q) - zero) * scale in f32 in place of the reader's f16 subgraph; an exact zero point of the
    reader's (None) is kept as its constant."""
    import openvino as ov
    from openvino import opset13 as ops

    weights = weight_convert.input_value(0)
    shape = [int(n) for n in subtract.get_output_partial_shape(0).to_shape()]
    groups_shape = [*shape[:-1], 1]
    as_f32 = ops.convert(weights, ov.Type.f32)
    if zero is None:
        zp = ops.convert(subtract.input_value(1), ov.Type.f32)
    else:
        zp = ops.constant(zero.reshape(groups_shape).astype(np.float32))
    exact = ops.multiply(ops.subtract(as_f32, zp), ops.constant(scale.reshape(groups_shape).astype(np.float32)))
    for target in list(multiply.output(0).get_target_inputs()):
        target.replace_source_output(exact.output(0))
