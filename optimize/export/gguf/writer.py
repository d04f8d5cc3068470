"""A Hugging Face causal LM (Llama or Qwen2) as one GGUF file laid out as llama.cpp's converter
lays one out: llama.cpp's tensor names, Llama's Q/K rows permuted to its rotary layout (pairs
interleaved), the hyperparameters under `{arch}.*`, the tokenizer under `tokenizer.*`, each matrix in
the type llama.cpp's rules give it for the file type (mixes.py). Written beside the target and
renamed into place, so a refused or failed write leaves nothing behind."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

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
    the quantized matrices it names."""
    import gguf

    check_file_type(file_type)
    config = module.config
    arch = architecture_of(config)
    tensors = gguf_tensors(module, config, arch)
    types = mixes.tensor_types(
        file_type, {k: v.shape for k, v in tensors.items()}, config.num_hidden_layers, bool(imatrix)
    )
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
        for tensor_name, data in tensors.items():
            weights = (imatrix or {}).get(tensor_name) if types[tensor_name] != "F32" else None
            stored, raw = quant.encode(data, types[tensor_name], weights)
            writer.add_tensor(tensor_name, stored, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return Written(out, file_type, types, bool(imatrix))


def gguf_tensors(module, config, arch: str) -> dict:
    """{GGUF tensor name: float32 array as stored}; an untied LM head is output.weight, a tied one is
    not written (llama.cpp reads token_embd.weight for both)."""
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
        data = tensor.detach().float().cpu().numpy()
        out[f"{mapped}.{suffix}"] = as_stored(data, mapped, config, arch)
    return out


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
