"""What a causal LM reads from memory to generate one token: its weights as stored (gathered tables one
row per token) and its KV cache. Counted from the engine's own files (ONNX initializers, OpenVINO
IR constants) or a torch module, so runners can say it and optimize/evaluate/roofline.py can turn it
into a bound on decode speed. Standard library and numpy only at import time.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

# ONNX ops whose listed inputs are tables read one row per token (by token id or position):
# input index -> gathered. GroupQueryAttention's cos/sin caches are inputs 7 and 8.
GATHERED_INPUTS = {
    "Gather": (0,),
    "GatherBlockQuantized": (0, 1, 2),
    "RotaryEmbedding": (2, 3),
    "GroupQueryAttention": (7, 8),
}

# onnx.TensorProto data types -> bits per element (4-bit types are packed two per byte).
ONNX_BITS = {
    1: 32,
    2: 8,
    3: 8,
    4: 16,
    5: 16,
    6: 32,
    7: 64,
    9: 8,
    10: 16,
    11: 64,
    12: 32,
    13: 64,
    16: 16,
    17: 8,
    18: 8,
    19: 8,
    20: 8,
    21: 4,
    22: 4,
}


@dataclass
class WeightBytes:
    """Bytes of weights read per generated token, and how they were counted."""

    per_token: int  # bytes read for one token
    stored: int  # bytes of all weights as stored
    gathered_tables: list[str] = field(default_factory=list)  # counted one row per token
    source: str = ""  # what was read: 'ONNX initializers of model.onnx', ...

    @property
    def counted(self) -> str:
        rows = f"; {len(self.gathered_tables)} gathered table(s) one row per token" if self.gathered_tables else ""
        return f"{self.source}: every weight whole{rows}"


# ---------------------------------------------------------------- weights: ONNX (ONNX Runtime GenAI)


def onnx_weight_bytes(onnx_path: str | Path) -> WeightBytes:
    """Weights read per token by an ONNX decoder: initializer sizes (external data is not loaded)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    sizes: dict[str, int] = {}
    rows: dict[str, int] = {}
    for init in graph.initializer:
        sizes[init.name] = _onnx_tensor_bytes(init)
        rows[init.name] = int(init.dims[0]) if len(init.dims) else 1
    gathered_by: set[str] = set()
    other_use: set[str] = set()
    for node in _all_nodes(graph):
        gathered = GATHERED_INPUTS.get(node.op_type, ())
        for i, name in enumerate(node.input):
            if name in sizes:
                (gathered_by if i in gathered else other_use).add(name)
    only_gathered = sorted(gathered_by - other_use)
    per_token = sum(size for name, size in sizes.items() if name not in only_gathered)
    per_token += sum(-(-sizes[name] // max(rows[name], 1)) for name in only_gathered)
    return WeightBytes(per_token, sum(sizes.values()), only_gathered, f"ONNX initializers of {Path(onnx_path).name}")


def _all_nodes(graph):
    """Nodes of the graph and of its subgraphs (If/Loop bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g is not None and len(attr.g.node):
                yield from _all_nodes(attr.g)
            for sub in attr.graphs:
                yield from _all_nodes(sub)


def _onnx_tensor_bytes(init) -> int:
    for entry in init.external_data:
        if entry.key == "length":
            return int(entry.value)
    count = int(np.prod(init.dims)) if len(init.dims) else 1
    return -(-count * ONNX_BITS.get(init.data_type, 32) // 8)


def onnx_kv_dtype_bytes(onnx_path: str | Path) -> Optional[int]:
    """Bytes per element of the KV cache: the element type of the graph's first past key input."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    for value in graph.input:
        if value.name.startswith("past_key_values") or value.name.startswith("past_key"):
            return ONNX_BITS.get(value.type.tensor_type.elem_type, 32) // 8
    return None


# ---------------------------------------------------------------- weights: OpenVINO IR


def openvino_weight_bytes(xml_path: str | Path) -> WeightBytes:
    """Weights read per token by an OpenVINO IR: the constants stored in its .bin (their `size`),
    a constant that reaches only a Gather's data input (directly or through the decompression chain
    Convert/Subtract/Multiply/Reshape NNCF writes) counted one row per token. Constants over the same
    bytes of the .bin (tied weights) are read once: whole if any of them is read whole."""
    root = ET.parse(str(xml_path)).getroot()
    layers = {str(layer.get("id")): layer for layer in root.iter("layer")}
    consumers: dict[str, list[tuple[str, int]]] = {}
    for edge in root.iter("edge"):
        consumers.setdefault(str(edge.get("from-layer")), []).append(
            (str(edge.get("to-layer")), int(edge.get("to-port") or 0))
        )
    port_index = {lid: _input_port_index(layer) for lid, layer in layers.items()}
    spans: dict[tuple[str, int], dict[str, Any]] = {}  # (offset, size) -> bytes, rows, names, read whole?
    for lid, layer in layers.items():
        data = layer.find("data")
        if layer.get("type") != "Const" or data is None or data.get("size") is None:
            continue
        size = int(data.get("size") or 0)
        shape = [int(d) for d in (data.get("shape") or "").split(",") if d.strip()]
        span = spans.setdefault(
            (data.get("offset") or lid, size),
            {"size": size, "rows": shape[0] if shape else 1, "names": [], "whole": False},
        )
        span["names"].append(layer.get("name") or lid)
        span["whole"] = span["whole"] or not _only_gathered(lid, layers, consumers, port_index)
    per_token = sum(sp["size"] if sp["whole"] else -(-sp["size"] // max(sp["rows"], 1)) for sp in spans.values())
    gathered = sorted(name for sp in spans.values() if not sp["whole"] for name in sp["names"])
    return WeightBytes(
        per_token, sum(sp["size"] for sp in spans.values()), gathered, f"constants of {Path(xml_path).stem}.bin"
    )


def _input_port_index(layer) -> dict[int, int]:
    """Port id -> position among the layer's inputs."""
    ports = layer.find("input")
    return {int(p.get("id")): i for i, p in enumerate(ports.findall("port"))} if ports is not None else {}


DECOMPRESSION = ("Convert", "Subtract", "Multiply", "Reshape", "Unsqueeze", "Squeeze")


def _only_gathered(lid, layers, consumers, port_index, depth=0) -> bool:
    uses = consumers.get(lid, [])
    if not uses or depth > 6:
        return False
    for to, port in uses:
        kind = layers[to].get("type")
        if kind == "Gather":
            if port_index[to].get(port, port) != 0:
                return False
        elif kind in DECOMPRESSION:
            if not _only_gathered(to, layers, consumers, port_index, depth + 1):
                return False
        else:
            return False
    return True


# ---------------------------------------------------------------- weights: PyTorch

# ---------------------------------------------------------------- KV cache


@dataclass
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    def bytes_per_token(self, context_tokens: int) -> int:
        """KV bytes read to generate one token with `context_tokens` tokens in the cache."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes * context_tokens


def kv_shape_from_hf_config(config: dict, dtype_bytes: int = 4) -> KVShape:
    """config.json of a Hugging Face decoder (Llama-style names)."""
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
    return KVShape(
        int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or heads), int(head_dim), dtype_bytes
    )


def kv_shape_from_genai_config(config: dict, dtype_bytes: int = 4) -> KVShape:
    """genai_config.json of an ONNX Runtime GenAI model."""
    decoder = config["model"]["decoder"]
    return KVShape(
        int(decoder["num_hidden_layers"]), int(decoder["num_key_value_heads"]), int(decoder["head_size"]), dtype_bytes
    )


def genai_read_bytes(model_dir: str | Path) -> tuple[WeightBytes, KVShape]:
    """Weights and KV shape of an ONNX Runtime GenAI folder (genai_config.json + its decoder ONNX)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "genai_config.json").read_text())
    onnx_path = model_dir / config["model"]["decoder"].get("filename", "model.onnx")
    dtype = onnx_kv_dtype_bytes(onnx_path) or 4
    return onnx_weight_bytes(onnx_path), kv_shape_from_genai_config(config, dtype)


# u4: a byte per code as OpenVINO 2026.4 allocates it (engines/openvino/genai_batch.py)
OV_KV_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "i8": 1, "u4": 1}


def openvino_folder_read_bytes(model_dir: str | Path, kv_cache_precision: str = "f32") -> tuple[WeightBytes, KVShape]:
    """Weights and KV shape of an OpenVINO GenAI folder (openvino_model.xml/.bin + config.json)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    return (
        openvino_weight_bytes(model_dir / "openvino_model.xml"),
        kv_shape_from_hf_config(config, OV_KV_BYTES.get(str(kv_cache_precision).lower(), 4)),
    )
