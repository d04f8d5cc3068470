"""Write a Hugging Face causal LM as a GGUF file laid out the way llama.cpp's converter
(convert_hf_to_gguf.py) lays one out, with the `gguf` package: llama.cpp's tensor names, its
metadata keys, Llama's Q/K rows permuted for its rotary layout, Gemma's norm weights stored as
1 + w, the BPE vocabulary, merges and chat template in the tokenizer keys.

Quantization: the `gguf` package quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 itself but only
dequantizes K-quants, so Q4_K, Q5_K and Q6_K are written here (q4_k_blocks, q5_k_blocks, q6_k_blocks:
llama.cpp's block layout, a plain min/max fit per 32-value sub-block rather than its search). As
llama.cpp does, a tensor whose rows do not fill whole K-quant super-blocks (256 values) falls back
(Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), and norms and biases stay F32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers model_type -> (gguf MODEL_ARCH name, general.architecture). Mistral is written as
# llama.cpp writes it: architecture "llama", the name saying "mistral".
GGUF_ARCH = {
    "llama": ("LLAMA", "llama"),
    "mistral": ("LLAMA", "llama"),
    "qwen2": ("QWEN2", "qwen2"),
    "qwen3": ("QWEN3", "qwen3"),
    "gemma2": ("GEMMA2", "gemma2"),
    "gemma3_text": ("GEMMA3", "gemma3"),
    "phi3": ("PHI3", "phi3"),
}
QK_K = 256


def write_gguf(folder: Path, out: Path, qtype="Q8_0", architecture: str | None = None) -> Path:
    """The model in `folder` (safetensors, config, tokenizer.json) as a GGUF file at `out`.
    `qtype` is one type for every matrix, or a function of the GGUF tensor name giving each its own
    (a file whose tensors mix types). `architecture` overrides general.architecture (to write a file
    of an architecture nobody reads)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    arch_name, gguf_arch = GGUF_ARCH[config.model_type]
    arch = architecture or gguf_arch
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{config.model_type}")
    _write_hparams(writer, config, _file_type(qtype))
    _write_tokenizer(writer, folder, config)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_name), config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        data = _as_stored(tensor.numpy(), name, config, gguf_arch)
        full = f"{name}.{suffix}"
        _add_tensor(writer, full, data, qtype(full) if callable(qtype) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _file_type(qtype) -> int:
    """general.file_type as llama.cpp writes it (OpenVINO GenAI's reader reads block scales only when it
    says the file is quantized): the type's MOSTLY_ value, Q4_K_M for K-quants and mixed files."""
    import gguf

    name = "Q4_K_M" if callable(qtype) or qtype == "Q4_K" else {"Q5_K": "Q5_K_M"}.get(qtype, qtype)
    return int(gguf.LlamaFileType[f"MOSTLY_{name}"]) if name not in ("F32",) else int(gguf.LlamaFileType.ALL_F32)


def _write_hparams(writer, config, file_type: int = 1) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(int(config.sliding_window))
    writer.add_file_type(file_type)


def _write_tokenizer(writer, folder: Path, config) -> None:
    """A byte-level BPE vocabulary as llama.cpp writes one (tokenizer model "gpt2"), with the
    pre-tokenizer llama.cpp must split text with ("default" splits SmolLM2's text unlike its own)."""
    from optimize.export.gguf.vocab import pre_name

    spec = json.loads((Path(folder) / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in spec.get("added_tokens", [])}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name(spec.get("pre_tokenizer"), Path(folder)))  # as the product's writer names it
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    merges = spec["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    tokenizer_config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    template = tokenizer_config.get("chat_template")
    if template is None and (Path(folder) / "chat_template.jinja").is_file():
        template = (Path(folder) / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _as_stored(data: np.ndarray, name: str, config, arch: str) -> np.ndarray:
    """What llama.cpp's converter stores for a tensor: Llama's Q/K rows permuted for its rotary
    layout (interleaved pairs), Gemma's RMSNorm weights as 1 + w (its norm multiplies by 1 + w)."""
    if arch == "llama" and (name.endswith("attn_q") or name.endswith("attn_k")):
        heads = config.num_attention_heads if name.endswith("attn_q") else config.num_key_value_heads
        data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
    if arch.startswith("gemma") and name.endswith("norm"):
        data = data + 1
    return np.ascontiguousarray(data, dtype=np.float32)


def _add_tensor(writer, name: str, data: np.ndarray, qtype: str) -> None:
    import gguf

    if data.ndim < 2 or qtype == "F32":
        writer.add_tensor(name, data)
        return
    if qtype == "F16":
        writer.add_tensor(name, data.astype(np.float16))
        return
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if data.shape[-1] % block:  # llama.cpp's fallback for rows a K-quant super-block does not fit
        qtype = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(qtype, "Q8_0")
        kind = getattr(gguf.GGMLQuantizationType, qtype)
    own = {"Q4_K": q4_k_blocks, "Q5_K": q5_k_blocks, "Q6_K": q6_k_blocks}
    packed = own[qtype](data) if qtype in own else gguf.quants.quantize(data, kind)
    writer.add_tensor(name, packed, raw_dtype=kind)


def q4_k_blocks(data: np.ndarray) -> np.ndarray:
    """Q4_K, llama.cpp's block_q4_K: per 256 values an f16 scale d and min dmin, 8 sub-blocks of 32
    with 6-bit scale and min (packed in 12 bytes), 4-bit values; x = d * sc * q - dmin * m."""
    return _k_blocks(data, 15)


def q5_k_blocks(data: np.ndarray) -> np.ndarray:
    """Q5_K, llama.cpp's block_q5_K: Q4_K's header, then 32 bytes of fifth bits (bit s of byte l is
    sub-block s's value l's) and Q4_K's nibbles; x = d * sc * q - dmin * m with q 0..31."""
    return _k_blocks(data, 31)


def _k_blocks(data: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (top 15) or Q5_K (top 31) super-blocks of `data`'s rows."""
    rows = data.reshape(-1, QK_K).astype(np.float32)
    sub = rows.reshape(len(rows), 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # the offset is a min <= 0, as llama.cpp's
    scale = (sub.max(axis=-1) - low) / top
    d = np.maximum(scale.max(axis=-1), 1e-12) / 63.0
    dmin = np.maximum((-low).max(axis=-1), 1e-12) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.rint(scale / _nonzero(d16)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / _nonzero(dmin16)[:, None]), 0, 63).astype(np.uint8)
    step = (d16.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin16.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.rint((sub + offset) / np.where(step > 0, step, 1.0)), 0, top).astype(np.uint8)
    packed_scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(len(rows), 128)  # sub-block 2j low nibbles, 2j+1 high
    head = [d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8), packed_scales]
    if top > 15:  # Q5_K: each value's fifth bit, sub-block s in bit s
        head.append(sum((q[:, s] >> 4).astype(np.uint8) << s for s in range(8)).astype(np.uint8))
    blocks = np.concatenate([*head, qs], axis=-1).astype(np.uint8)
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // QK_K * blocks.shape[-1])


def q6_k_blocks(data: np.ndarray) -> np.ndarray:
    """Q6_K, llama.cpp's block_q6_K: per 256 values 128 bytes of low nibbles, 64 of high 2-bit pairs,
    16 int8 sub-block scales (16 values each) and an f16 scale d; x = d * sc * (q - 32)."""
    rows = data.reshape(-1, QK_K).astype(np.float32)
    sub = rows.reshape(len(rows), 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0
    d = np.maximum(scale.max(axis=-1), 1e-12) / 127.0
    d16 = d.astype(np.float16)
    sc = np.clip(np.rint(scale / _nonzero(d16)[:, None]), -128, 127).astype(np.int8)
    step = (d16.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.rint(sub / np.where(step > 0, step, 1.0)), -32, 31) + 32).astype(np.uint8).reshape(len(rows), QK_K)
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate(
        [lo[:, h * 128 : h * 128 + 64] | (lo[:, h * 128 + 64 : h * 128 + 128] << 4) for h in (0, 1)], -1
    )
    qh = np.concatenate(
        [sum(hi[:, h * 128 + s * 32 : h * 128 + (s + 1) * 32] << (2 * s) for s in range(4)) for h in (0, 1)], -1
    )
    blocks = np.concatenate([ql, qh.astype(np.uint8), sc.view(np.uint8), d16[:, None].view(np.uint8)], axis=-1).astype(
        np.uint8
    )
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // QK_K * 210)


def _nonzero(d16: np.ndarray) -> np.ndarray:
    """A super-block's f16 scale as f32, 1 where it rounded to 0 (an all-zero block, e.g. the padding
    token's embedding row): its sub-block scales then come out 0 rather than 0/0."""
    d = d16.astype(np.float32)
    return np.where(d > 0, d, 1.0)


def rewrite_gguf(src: Path, out: Path, fields: dict | None = None, tensors: dict | None = None) -> Path:
    """`src` written again to `out` (laid out afresh by the `gguf` package) with some of it replaced:
    `fields` {key: value, (value, GGUFValueType), or None to drop it}; `tensors` {name: array (its
    dtype's type: F32 or F16), (raw bytes, GGMLQuantizationType), or None to drop it; a name `src`
    lacks is added}. What a hostile or broken file holds, the rest as the original has it."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    fields, tensors = fields or {}, tensors or {}
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in fields:
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in fields.items():
        if value is None:
            continue
        value, kind = value if isinstance(value, tuple) else (value, gguf.GGUFValueType.get_type(value))
        writer.add_key_value(key, value, kind)
    stored = {t.name: (np.asarray(t.data), t.tensor_type) for t in reader.tensors}
    for name in [*stored, *(n for n in tensors if n not in stored)]:  # a name not in `src` is added
        replaced = tensors.get(name, stored.get(name))
        if replaced is None:
            continue
        data, kind = replaced if isinstance(replaced, tuple) else (replaced, None)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            kind = None  # the array's own dtype says it
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def edit_tensor_info(path: Path, name: str, offset: int | None = None, dims: list[int] | None = None) -> None:
    """Edit a tensor's entry in the file's header in place: its data offset (relative to the data
    section, as stored) or its dimensions (row length first, the same count of them)."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    info = next(t for t in reader.tensors if t.name == name).field
    if offset is not None:
        info.parts[-1][0] = offset  # [name length, name, dim count, dims, type, offset]
    if dims is not None:
        info.parts[3][:] = dims


def tensor_offsets(path: Path) -> dict[str, int]:
    """{name: data offset relative to the data section} as the file stores them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: int(t.field.parts[-1][0]) for t in reader.tensors}
