"""A Hugging Face causal LM (Llama or Qwen2) as one GGUF file laid out as llama.cpp's converter
lays one out: llama.cpp's tensor names, Llama's Q/K rows permuted to its rotary layout (pairs
interleaved), the hyperparameters under `{arch}.*`, the tokenizer under `tokenizer.*`, each matrix in
the type llama.cpp's rules give it for the file type (mixes.py). Written beside the target and
renamed into place, so a refused or failed write leaves nothing behind."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from optimize.export.gguf import ARCHITECTURES, ExportError, check_file_type, mixes, quant, vocab


@dataclass
class Written:
    path: Path
    file_type: str
    types: dict = field(default_factory=dict)  # {tensor: GGUF type}, in file order
    imatrix: bool = False

    def summary(self) -> dict:
        """{type: tensors of that type}, the manifest's short form."""
        counts: dict[str, int] = {}
        for kind in self.types.values():
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def architecture_of(config) -> str:
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        raise ExportError(f"model type {kind!r}: the GGUF writer writes {', '.join(ARCHITECTURES)} models")
    rope = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        raise ExportError(f"{kind} with {rope_type!r} rope scaling: the GGUF writer writes plain rotary positions")
    return ARCHITECTURES[kind]


def write(
    module,
    out: Path,
    file_type: str,
    *,
    tokenizer_dir: Path | None = None,
    tokenizer_gguf: Path | None = None,
    imatrix: dict | None = None,
    name: str | None = None,
) -> Written:
    """`module` as a GGUF of `file_type` at `out`; the tokenizer copied from `tokenizer_gguf` (a GGUF
    source) or built from `tokenizer_dir`; `imatrix` {GGUF tensor name: mean squared input} rounds
    the quantized matrices it names.

    Streamed: every tensor's name, shape and type follow from the module's shapes, so the header and
    the tensor table are written first, then each tensor is converted to FP32, permuted and quantized
    a block of rows at a time and written, so the writer holds one block in FP32 (and its quantized
    bytes), never the model."""
    import gguf

    check_file_type(file_type)
    config = module.config
    arch = architecture_of(config)
    sources = source_tensors(module, config, arch)
    shapes = {tensor_name: tuple(tensor.shape) for tensor_name, tensor in sources.items()}
    types = mixes.tensor_types(file_type, shapes, config.num_hidden_layers, bool(imatrix))
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    try:
        write_header(writer, config, file_type, name)
        if tokenizer_gguf is not None:
            vocab.copy_from_gguf(writer, tokenizer_gguf)
        elif tokenizer_dir is not None:
            vocab.write_from_folder(writer, Path(tokenizer_dir), config)
        else:
            raise ExportError("a GGUF needs the model's tokenizer: give its folder or GGUF source")
        for tensor_name, shape in shapes.items():
            kind = types[tensor_name]
            raw = gguf.GGMLQuantizationType[kind]
            writer.add_tensor_info(tensor_name, shape, np.dtype(np.float32), stored_nbytes(shape, kind), raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor_name, tensor in sources.items():
            kind = types[tensor_name]
            weights = (imatrix or {}).get(tensor_name) if kind != "F32" else None
            blocks = stored_blocks(tensor, tensor_name, config, arch)
            write_tensor(writer, tensor_name, (quant.encode(rows, kind, weights)[0] for rows in blocks))
        writer.close()
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return Written(out, file_type, types, bool(imatrix))


# FP32 values converted, permuted and quantized at once (32 MB). Every type written rounds each row on
# its own (blocks of 32 or 256 values within a row), so a tensor's bytes are the same whether its rows
# are rounded a block at a time or all at once.
BLOCK_VALUES = 8 << 20


def stored_nbytes(shape: tuple, kind: str) -> int:
    """A tensor's bytes in the file: its rows in `kind`'s blocks (llama.cpp's type sizes)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows * (shape[-1] // block) * size


def write_tensor(writer, tensor_name: str, blocks: Iterator[np.ndarray]) -> None:
    """The table's next tensor written block by block where the writer's own write_tensor_data takes
    it whole: aligned at its start, padded at its end, as many bytes as the table says."""
    fout = writer.fout[0]
    expected = writer.tensors[0].pop(tensor_name).nbytes
    writer.write_padding(fout, fout.tell())
    written = 0
    for block in blocks:
        block.tofile(fout)
        written += block.nbytes
    if written != expected:
        raise ExportError(f"tensor {tensor_name}: {written} bytes written where the table says {expected}")
    writer.write_padding(fout, written)


def source_tensors(module, config, arch: str) -> dict:
    """{GGUF tensor name: the module's tensor in its own precision}, in file order; an untied LM head
    is output.weight, a tied one is not written (llama.cpp reads token_embd.weight for both)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = {}
    for hf_name, tensor in module.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        base, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(base)
        if mapped is None:
            raise ExportError(f"tensor {hf_name}: the GGUF writer has no {arch} name for it")
        out[f"{mapped}.{suffix}"] = tensor.detach()
    return out


def stored_blocks(tensor, name: str, config, arch: str) -> Iterator[np.ndarray]:
    """The tensor as stored (FP32, in llama.cpp's layout), a block of whole rows at a time. A permuted
    Q/K matrix (hidden x hidden at most) and a vector are converted whole."""
    if tensor.dim() < 2 or permuted(name, arch):
        yield as_stored(tensor.float().cpu().numpy(), name.rpartition(".")[0], config, arch)
        return
    step = max(1, BLOCK_VALUES // int(np.prod(tensor.shape[1:])))
    for start in range(0, tensor.shape[0], step):
        yield np.ascontiguousarray(tensor[start : start + step].float().cpu().numpy(), dtype=np.float32)


def permuted(name: str, arch: str) -> bool:
    return arch == "llama" and name.rpartition(".")[0].endswith((".attn_q", ".attn_k"))


def gguf_tensors(module, config, arch: str) -> dict:
    """{GGUF tensor name: float32 array as stored}, every tensor at once: for checks on small models
    (the writer streams them, stored_blocks)."""
    return {
        name: np.concatenate(list(stored_blocks(tensor, name, config, arch)))
        for name, tensor in source_tensors(module, config, arch).items()
    }


def as_stored(data: np.ndarray, name: str, config, arch: str) -> np.ndarray:
    """Llama's attn_q / attn_k rows reordered from Hugging Face's rotary layout (first half, second
    half of each head) to llama.cpp's (pairs side by side); Qwen2 keeps Hugging Face's (NEOX) layout."""
    if arch == "llama" and name.endswith((".attn_q", ".attn_k")):
        heads = config.num_attention_heads if name.endswith(".attn_q") else config.num_key_value_heads
        data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
    return np.ascontiguousarray(data, dtype=np.float32)


def write_header(writer, config, file_type: str, name: str | None) -> None:
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_type("model")
    writer.add_name(name or getattr(config, "_name_or_path", "") or config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_freq_base(float(rope_theta(config)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{file_type}"]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = (params.get("full_attention") or params).get("rope_theta", 10000.0)
    return float(theta)
