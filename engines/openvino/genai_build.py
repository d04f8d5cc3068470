"""Building OpenVINO GenAI causal-LM folders: a Hugging Face Llama-style model -> a stateful IR with its
KV cache held inside the model (what `openvino_genai.LLMPipeline` runs), the OpenVINO tokenizer and
detokenizer, the config files the pipeline reads (NNCF weight compression is engines/openvino/genai_compress.py).
Pure functions over folders; the pipeline decides what to build and records it.

The IR's interface is the one LLMPipeline expects (and optimum-intel writes): inputs input_ids,
attention_mask, position_ids [batch, tokens] (i64) and beam_idx [batch] (i32); output logits
[batch, tokens, vocab]. Every layer's past key and value are internal state (ReadValue/Assign pairs,
zeros at the start of a sequence, reset by the caller between sequences), reordered along the batch
axis by beam_idx at every step (a Gather, for beam search). Weights are kept FP32.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional, cast

import numpy as np

log = logging.getLogger(__name__)

IR_FILE = "openvino_model.xml"
TOKENIZER_FILE = "openvino_tokenizer.xml"
DETOKENIZER_FILE = "openvino_detokenizer.xml"
# The Hugging Face files LLMPipeline (and the runner) read beside the IR: the model config (context
# length, vocabulary), the generation defaults (EOS ids), the tokenizer and its chat template.
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
# The mask value for hidden positions: float16's minimum, as optimum-intel uses, rather than
# float32's (a score plus float32's minimum can overflow to -inf, and a row of -inf gives NaN).
MASK_MIN = -65504.0


class ExportError(RuntimeError):
    """The model cannot be exported (not a decoder with a KV cache we know how to lay out)."""


def _cache_layout(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of a Llama-style decoder config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers, kv_heads, head_dim


def _wrapper(model, layers: int):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present), past and present
    flattened as (key 0, value 0, key 1, ...), each [batch, kv heads, tokens, head size].

    The 4D additive mask is built here from the 2D attention mask with tensor ops only (no Python
    ints taken from shapes, which a trace would freeze), so one IR serves every prompt and cache length;
    transformers returns a prepared 4D mask as it is."""
    import inspect

    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer

    # transformers 5.x renamed past_key_values to cache (the old name still works, with a warning)
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    window, layer_types = sliding_layers(model.config)

    class StatefulLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache()
            cache.layers = []
            for i in range(layers):
                layer = DynamicLayer()
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.device, layer.is_initialized = past[2 * i].device, True
                layer.dtype = past[2 * i].dtype  # type: ignore[attr-defined]  # not declared on DynamicLayer; set as before
                cache.layers.append(layer)
            ones_kv = torch.ones_like(attention_mask)
            kv_pos = torch.cumsum(ones_kv, dim=1) - 1  # [B, K]: 0..K-1
            past_len = ones_kv.sum(dim=1, keepdim=True) - torch.ones_like(input_ids).sum(dim=1, keepdim=True)
            q_pos = past_len + torch.cumsum(torch.ones_like(input_ids), dim=1) - 1  # [B, Q]: K-Q..K-1
            visible = (kv_pos[:, None, None, :] <= q_pos[:, None, :, None]) & (attention_mask[:, None, None, :] > 0)
            mask = _masks(visible, q_pos, kv_pos, window, layer_types)
            out = self.lm(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                **{cache_kwarg: cache},
                use_cache=True,
                return_dict=True,
            )
            present = []  # the cache object was updated in place
            for layer in cast("list[DynamicLayer]", cache.layers):  # the layers built above
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return StatefulLM().eval()


def sliding_layers(config) -> tuple[Optional[int], Optional[list]]:
    """(window, layer types) of a decoder with sliding-window layers, else (None, None): Gemma 2/3 and
    Qwen name each layer's kind in layer_types; Mistral has a window and no layer types (every layer
    slides, as transformers runs it)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None, None
    return int(window), list(types) if types is not None else None


def _masks(visible, q_pos, kv_pos, window: Optional[int], layer_types: Optional[list]):
    """The additive mask(s) the decoder is given: one for causal attention, or with sliding-window
    layers the masks per layer kind (a 4D mask given to transformers is used as it is, so a window
    it would have applied must be in the mask itself). A query at position q sees keys k with
    q - k < window, transformers' definition. Positions are tensors ([B, Q] and [B, K]), so the
    trace keeps them dynamic."""
    import torch

    def additive(allowed):
        return torch.where(allowed, torch.tensor(0.0), torch.tensor(MASK_MIN))

    if window is None:
        return additive(visible)
    sliding = additive(visible & (q_pos[:, None, :, None] - kv_pos[:, None, None, :] < window))
    if layer_types is None:
        return sliding
    return {"full_attention": additive(visible), "sliding_attention": sliding}


def _load_fp32(hf_folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    # SDPA where the architecture has it; eager where it does not (Gemma 2: its attention soft-capping)
    for attention in ("sdpa", "eager"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(hf_folder), dtype=torch.float32, attn_implementation=attention
            )
            return model.eval()
        except ValueError as exc:
            if attention == "sdpa" and "attention implementation" in str(exc):
                continue
            raise ExportError(f"cannot load a causal LM from {hf_folder}: {str(exc).splitlines()[0]}") from None
        except OSError as exc:
            raise ExportError(f"cannot load a causal LM from {hf_folder}: {str(exc).splitlines()[0]}") from None
    raise AssertionError("unreachable")


def convert_decoder(model):
    """The traced decoder as an ov.Model with named inputs and outputs, cache still explicit."""
    import openvino as ov
    import torch

    layers, kv_heads, head_dim = _cache_layout(model.config)
    batch, new, past = 2, 3, 4  # distinct sizes, so no dimension is mistaken for another
    example = {
        "input_ids": torch.randint(1, min(int(model.config.vocab_size), 100), (batch, new)),
        "attention_mask": torch.ones(batch, past + new, dtype=torch.int64),
        "position_ids": torch.arange(past, past + new).repeat(batch, 1),
    }
    cache = [torch.randn(batch, kv_heads, past, head_dim) * 0.1 for _ in range(2 * layers)]
    names = list(example)
    for i in range(layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    shapes = [([-1, -1], ov.Type.i64)] * 3 + [([-1, kv_heads, -1, head_dim], ov.Type.f32)] * (2 * layers)
    with torch.no_grad():
        ov_model = ov.convert_model(_wrapper(model, layers), example_input=(*example.values(), *cache), input=shapes)
    for port, name in zip(ov_model.inputs, names):
        port.get_tensor().set_names({name})
    outputs = ["logits"] + [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    if len(ov_model.outputs) != len(outputs):
        raise ExportError(f"the traced decoder has {len(ov_model.outputs)} outputs, expected {len(outputs)}")
    for port, name in zip(ov_model.outputs, outputs):
        port.get_tensor().set_names({name})
    return ov_model, names[3:], outputs[1:]


def make_stateful(ov_model, past_names: list[str], present_names: list[str]) -> None:
    """Cache in, cache out -> internal state, in place: a beam_idx input whose Gather reorders every
    cache input along the batch axis (fused beam reordering), the make-stateful transformation, and
    zero initial values shaped from input_ids' batch (so a reset state starts a fresh sequence)."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    batch_dim = ov_model.input("input_ids").get_partial_shape()[0]
    beam_idx = opset13.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([batch_dim]))
    beam_idx.output(0).get_tensor().add_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in past_names:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    ov_model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(ov_model, dict(zip(past_names, present_names)))
    input_ids = ov_model.input("input_ids")
    batch = opset13.gather(opset13.shape_of(input_ids, output_type="i64"), opset13.constant([0]), opset13.constant(0))
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in op.get_output_partial_shape(0)]
            parts = [batch if i == 0 else opset13.constant(np.array([d], dtype=np.int64)) for i, d in enumerate(dims)]
            zeros = opset13.broadcast(
                opset13.constant(0.0, dtype=op.get_output_element_type(0)), opset13.concat(parts, axis=0)
            )
            op.set_arguments([zeros])
    ov_model.validate_nodes_and_infer_types()


def save_ir(ov_model, out_dir: Path) -> Path:
    """openvino_model.xml + .bin, weights as they are (save_model would halve FP32 weights to FP16)."""
    import openvino as ov

    out_dir.mkdir(parents=True, exist_ok=True)
    xml = out_dir / IR_FILE
    ov.save_model(ov_model, str(xml), compress_to_fp16=False)
    return xml


def set_activation_quantization(ov_model, group_size: int) -> None:
    """The CPU plugin's dynamic quantization of activations (INT8 in groups of `group_size` channels
    beside 4/8-bit weights; 0: off, activations stay f32) written into the IR's runtime options, where
    every runner that compiles it reads it: scoring, LLMPipeline and the continuous-batching pipeline."""
    ov_model.set_rt_info(str(group_size), ["runtime_options", "DYNAMIC_QUANTIZATION_GROUP_SIZE"])


def rewrite_activation_quantization(xml: Path, group_size: int) -> None:
    """set_activation_quantization on a saved IR."""
    rewrite_ir(xml, lambda model: set_activation_quantization(model, group_size))


def rewrite_ir(xml: Path, change):
    """`change(model)` on the IR at xml, the result written beside it, then moved over it (the old
    .bin is read while the new one is written); returns what `change` returned."""
    import openvino as ov

    model = ov.Core().read_model(str(xml))
    result = change(model)
    staged = xml.parent / ".rewritten"
    shutil.rmtree(staged, ignore_errors=True)
    written = save_ir(model, staged)
    del model  # the old .bin is no longer read
    for path in (written, written.with_suffix(".bin")):
        path.replace(xml.parent / path.name)
    staged.rmdir()
    return result


def convert_tokenizer(hf_folder: Path, out_dir: Path) -> None:
    """openvino_tokenizer.xml and openvino_detokenizer.xml (openvino_tokenizers), with the chat template
    and special tokens in their runtime info, where LLMPipeline reads them."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer as ov_convert
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_folder))
    tokenizer, detokenizer = ov_convert(hf_tokenizer, with_detokenizer=True)
    ov.save_model(tokenizer, str(out_dir / TOKENIZER_FILE))
    ov.save_model(detokenizer, str(out_dir / DETOKENIZER_FILE))


def copy_configs(hf_folder: Path, out_dir: Path, model_config=None) -> None:
    """The config files beside the IR; a generation_config.json is written from the model config when
    the folder has none (LLMPipeline takes its EOS ids from it)."""
    for name in CONFIG_FILES:
        if (hf_folder / name).is_file():
            shutil.copy2(hf_folder / name, out_dir / name)
    if not (out_dir / "generation_config.json").is_file() and model_config is not None:
        settings = {k: getattr(model_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (out_dir / "generation_config.json").write_text(
            json.dumps({k: v for k, v in settings.items() if v is not None}, indent=2)
        )


def export_stateful_lm(hf_folder: str | Path, out_dir: str | Path) -> Path:
    """A Hugging Face causal-LM folder (Llama-style, loaded in FP32 with SDPA attention) -> out_dir
    holding the stateful FP32 IR, the OpenVINO tokenizer/detokenizer and the config files that
    `openvino_genai.LLMPipeline(out_dir, "CPU")` reads. Returns the IR's path."""
    from engines.openvino.build import no_telemetry

    no_telemetry()
    hf_folder, out_dir = Path(hf_folder), Path(out_dir)
    model = _load_fp32(hf_folder)
    ov_model, past, present = convert_decoder(model)
    make_stateful(ov_model, past, present)
    xml = save_ir(ov_model, out_dir)
    convert_tokenizer(hf_folder, out_dir)
    copy_configs(hf_folder, out_dir, model.config)
    return xml
