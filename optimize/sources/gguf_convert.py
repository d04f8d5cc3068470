"""A GGUF file as a Hugging Face folder, converted a tensor at a time.

transformers loads a GGUF of the llama, mistral, qwen2 and gemma2/3 families by dequantizing every
tensor into one FP32 model held in memory (a 1.5B model: 6.2 GB of weights, and the process near
10 GB). Here the same steps run one tensor at a time: each tensor is dequantized by the gguf package
(what transformers calls), passed through transformers' own tensor processor for the architecture
(the q/k row permutations llama.cpp applied, Gemma's norm offsets) and renamed by its own name map,
then written to a safetensors shard; a shard is flushed once it holds `shard_bytes`. Peak memory is
one shard plus the largest tensor, not the model. The folder's weights are the values transformers'
loader gives, bit for bit (tests/optimize/test_gguf_sources.py compares them), and loading the
folder in FP32 memory-maps it (file pages the kernel can drop, not a second copy of the model).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from optimize.errors import RecipeError

log = logging.getLogger(__name__)

# 1 GiB: a model up to 256M parameters (SmolLM2-135M) is one model.safetensors, as save_pretrained wrote it.
SHARD_BYTES = 1 << 30


def convert(gguf_path: Path, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Write config.json, generation_config.json, the tokenizer and FP32 safetensors shards (with
    model.safetensors.index.json when there are several) of the model in `gguf_path` into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)  # the metadata only
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder holds plain FP32 weights
    with torch.device("meta"):  # the parameter names, no storage
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.dtype = "float32"
    out.mkdir(parents=True, exist_ok=True)
    names = _write_tensors(gguf_path, skeleton, out, shard_bytes)
    missing = sorted(set(_stored_names(skeleton)) - set(names))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise RecipeError(f"{gguf_path.name} lacks {len(missing)} of the model's weights ({shown})")
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))


def _stored_names(model) -> list[str]:
    """The parameter names a checkpoint of `model` holds (a tied LM head is not stored)."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    tie = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    return [n for n, _ in model.named_parameters() if not (tie and n in tied)]


def _write_tensors(gguf_path: Path, skeleton, out: Path, shard_bytes: int) -> list[str]:
    """Each tensor of the file dequantized, processed and renamed as transformers' loader does,
    written in shards; returns the names written."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    reader = GGUFReader(str(gguf_path))
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    shards: list[dict[str, str]] = []
    pending: dict = {}
    pending_bytes = 0
    written: list[str] = []
    for tensor in reader.tensors:
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=mapping,
            parsed_parameters={"tensors": {}},
        )
        if result.name is None or result.name not in mapping:
            continue  # what transformers' loader skips too (check_gguf_source refused unknown tensors)
        name = mapping[result.name]
        pending[name] = torch.from_numpy(np.copy(result.weights))
        pending_bytes += pending[name].nbytes
        written.append(name)
        if pending_bytes >= shard_bytes:
            shards.append(_flush(pending, out, len(shards), save_file))
            pending, pending_bytes = {}, 0
    if pending or not shards:
        shards.append(_flush(pending, out, len(shards), save_file))
    _name_shards(shards, out)
    return written


def _flush(tensors: dict, out: Path, index: int, save_file) -> dict[str, str]:
    name = f"shard-{index:05d}.safetensors"
    save_file(tensors, str(out / name), metadata={"format": "pt"})
    return {key: name for key in tensors}


def _name_shards(shards: list[dict[str, str]], out: Path) -> None:
    """One shard: model.safetensors; several: model-0000i-of-0000n.safetensors and the index."""
    if len(shards) == 1:
        (out / "shard-00000.safetensors").rename(out / "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i:05d}.safetensors").rename(out / final)
        total += (out / final).stat().st_size
        weight_map.update({key: final for key in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
