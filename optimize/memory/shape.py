"""A model's size read from its files, never loading its weights: the safetensors headers of a Hugging
Face folder, a GGUF file's header, or (for a folder with no weights yet) its config.json."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from optimize.errors import RecipeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    disk_bytes: int  # the weights as they come (a GGUF's blocks, a folder's safetensors shards)
    kind: str  # "folder", "gguf" or "config"
    dtype: str = ""  # the precision most of the weights are stored in
    # K and V of one token over every layer at 16 bits (0: not known): what a served sequence holds per
    # token; a runtime keeping its KV cache in 8 bits holds half.
    kv_bytes_per_token: int = 0

    def words(self) -> str:
        size = f"{self.disk_bytes / 1e9:.{2 if self.disk_bytes < 1e9 else 1}f} GB"
        stored = {
            "folder": f"{size} of {self.dtype} safetensors",
            "gguf": f"a {size} GGUF file",
            "config": f"{size} in {self.dtype}, read from config.json",
        }[self.kind]
        return f"{self.parameters / 1e9:.2f}B parameters ({stored})"


def of_source(kind: str, path: Optional[Path]) -> Optional[ModelShape]:
    """The shape of a resolved source (optimize.sources.models.resolve's kind and path); None where its size
    cannot be read without loading it (a hub id, an ONNX graph, a pickled checkpoint)."""
    if path is None or kind not in ("folder", "gguf"):
        return None
    try:
        return of_folder(path) if kind == "folder" else of_gguf(path)
    except RecipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable header: the estimate is skipped, not the run
        # The plan only estimates; a source whose headers it cannot read (an empty or torn safetensors
        # file, a config.json without a decoder's keys) is refused by the loader with its own one line.
        log.debug("memory plan skipped: %s cannot be sized (%s)", path, exc)
        return None


def of_folder(folder: Path) -> ModelShape:
    """From the safetensors headers: every tensor's shape and dtype, no tensor read."""
    from safetensors import safe_open

    parameters, bytes_by_dtype = 0, dict[str, int]()
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        return of_config(json.loads((folder / "config.json").read_text()))
    for shard in shards:
        with safe_open(str(shard), framework="numpy") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                count = _product(tensor.get_shape())
                parameters += count
                dtype = tensor.get_dtype()
                bytes_by_dtype[dtype] = bytes_by_dtype.get(dtype, 0) + count
    dtype = max(bytes_by_dtype, key=bytes_by_dtype.__getitem__) if bytes_by_dtype else ""
    config = folder / "config.json"
    kv = kv_bytes_of_config(json.loads(config.read_text())) if config.is_file() else 0
    return ModelShape(parameters, sum(s.stat().st_size for s in shards), "folder", dtype, kv)


def of_gguf(path: Path) -> ModelShape:
    from optimize.sources.gguf_header import read_header

    header = read_header(path)
    parameters = sum(_product(dims) for dims, *_ in header.tensors.values())
    return ModelShape(parameters, path.stat().st_size, "gguf", "gguf blocks", _kv_bytes_of_gguf(header.metadata))


def of_config(config: dict) -> ModelShape:
    """A decoder's parameter count from its config.json alone (Llama, Qwen2, Mistral, Gemma layouts:
    attention with grouped KV heads, a gated MLP, two norms a layer), stored at its torch_dtype."""
    width, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or width // heads)
    ffn, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    attention = width * head_dim * (heads + 2 * kv_heads) + heads * head_dim * width
    per_layer = attention + 3 * width * ffn + 2 * width
    embeddings = vocab * width * (1 if config.get("tie_word_embeddings", True) else 2)
    parameters = layers * per_layer + embeddings + width
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    return ModelShape(parameters, parameters * size, "config", dtype, kv_bytes_of_config(config))


def kv_bytes_of_config(config: dict) -> int:
    """K and V of one token over every layer at 16 bits, from a decoder's config.json (0 where it has
    no decoder's keys)."""
    try:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return 2 * int(config["num_hidden_layers"]) * int(config.get("num_key_value_heads") or heads) * head_dim * 2
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0


def _kv_bytes_of_gguf(metadata: dict) -> int:
    """The same from a GGUF's metadata ({arch}.block_count, attention.head_count(_kv), key_length or
    embedding_length / head_count); 0 where a count is missing or given per layer."""
    arch = metadata.get("general.architecture")
    keys = ("block_count", "attention.head_count", "embedding_length")
    layers, heads, width = (metadata.get(f"{arch}.{k}") for k in keys)
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 and not isinstance(head_dim, int):
        head_dim = width // heads
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return 0
    return 2 * layers * kv_heads * head_dim * 2 if min(layers, kv_heads, head_dim) > 0 else 0


def _product(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n
