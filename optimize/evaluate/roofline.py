"""Memory roofline for causal-LM decoding: how fast could greedy decode go if it only had to read memory?

At batch 1 each generated token reads every weight matrix once, plus the KV cache of the tokens so
far; the arithmetic is small next to that, so decode tokens/s can not exceed

    bound_tok_s = bandwidth / (weight_bytes_per_token + kv_bytes_per_token)

and `share = measured decode tok/s / bound_tok_s` says how much of the machine's memory bandwidth a
runtime turns into tokens.

What is counted as read per token:
- every weight tensor a matrix multiply (or any non-gather op) consumes, whole, at its stored size
  (MatMulNBits: the packed 4/8-bit weights, their scales and zero points; FP32 weights at 4 bytes);
- tables that are only gathered by token id or position (the embedding table read by Gather or
  GatherBlockQuantized, rotary cos/sin caches read by position): one row per token, since that is
  all a lookup touches. A table that is gathered *and* multiplied (an embedding tied to the LM head
  and shared in the graph) is read whole by the multiply and counted once, whole;
- the KV cache: layers x 2 (K and V) x kv_heads x head_dim x bytes per element x context tokens.

Ignored: activations (a few KB per token at batch 1), and the caches: a model larger than the
last-level cache is streamed from DRAM each token; a model that fits could beat this bound.

Bandwidth is measured at run time: numpy sums over a float64 buffer 4x the L3 cache, split over the
run's threads (numpy releases the GIL in reductions), best of N repeats in about half a second.
numpy's sum does not use BLAS, so OPENBLAS_NUM_THREADS and friends do not change it.
"""
from __future__ import annotations

import json
import os
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

NOT_KNOWN = "not known"

# ONNX ops whose listed inputs are tables read one row per token (by token id or position):
# input index -> gathered. GroupQueryAttention's cos/sin caches are inputs 7 and 8.
GATHERED_INPUTS = {
    "Gather": (0,),
    "GatherBlockQuantized": (0, 1, 2),
    "RotaryEmbedding": (2, 3),
    "GroupQueryAttention": (7, 8),
}

# onnx.TensorProto data types -> bits per element (4-bit types are packed two per byte).
ONNX_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64,
             16: 16, 17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4}


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
            (str(edge.get("to-layer")), int(edge.get("to-port") or 0)))
    port_index = {lid: _input_port_index(layer) for lid, layer in layers.items()}
    spans: dict[tuple[str, int], dict[str, Any]] = {}  # (offset, size) -> bytes, rows, names, read whole?
    for lid, layer in layers.items():
        data = layer.find("data")
        if layer.get("type") != "Const" or data is None or data.get("size") is None:
            continue
        size = int(data.get("size") or 0)
        shape = [int(d) for d in (data.get("shape") or "").split(",") if d.strip()]
        span = spans.setdefault((data.get("offset") or lid, size),
                                {"size": size, "rows": shape[0] if shape else 1, "names": [], "whole": False})
        span["names"].append(layer.get("name") or lid)
        span["whole"] = span["whole"] or not _only_gathered(lid, layers, consumers, port_index)
    per_token = sum(sp["size"] if sp["whole"] else -(-sp["size"] // max(sp["rows"], 1)) for sp in spans.values())
    gathered = sorted(name for sp in spans.values() if not sp["whole"] for name in sp["names"])
    return WeightBytes(per_token, sum(sp["size"] for sp in spans.values()), gathered,
                       f"constants of {Path(xml_path).stem}.bin")


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

def torch_weight_bytes(model) -> WeightBytes:
    """Parameters of a torch module (each tensor once, tied ones too); an nn.Embedding whose weight
    no other module uses counts one row per token."""
    import torch

    owners: dict[int, list[torch.nn.Module]] = {}
    tensors: dict[int, tuple[str, Any]] = {}
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            key = id(param)
            owners.setdefault(key, []).append(module)
            tensors.setdefault(key, (f"{module_name}.{pname}".strip("."), param))
    per_token = stored = 0
    gathered = []
    for key, (name, param) in tensors.items():
        size = param.numel() * param.element_size()
        stored += size
        if all(isinstance(m, torch.nn.Embedding) for m in owners[key]) and param.dim() >= 1:
            per_token += -(-size // max(param.shape[0], 1))
            gathered.append(name)
        else:
            per_token += size
    return WeightBytes(per_token, stored, sorted(gathered), "torch parameters")


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
    return KVShape(int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or heads),
                   int(head_dim), dtype_bytes)


def kv_shape_from_genai_config(config: dict, dtype_bytes: int = 4) -> KVShape:
    """genai_config.json of an ONNX Runtime GenAI model."""
    decoder = config["model"]["decoder"]
    return KVShape(int(decoder["num_hidden_layers"]), int(decoder["num_key_value_heads"]),
                   int(decoder["head_size"]), dtype_bytes)


# ---------------------------------------------------------------- bandwidth

def l3_bytes(default: int = 32 << 20) -> int:
    """The last-level cache size from sysfs (Linux), else `default`."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or default


def read_bandwidth(threads: int = 1, budget_s: float = 0.5, buffer_bytes: int | None = None,
                   repeats: int = 20) -> dict:
    """Memory read bandwidth in GB/s (1e9 bytes/s): sum of a float64 buffer 4x the L3 cache (at least
    64 MiB), split in `threads` parts summed concurrently; best of up to `repeats` passes within
    `budget_s` (one pass always)."""
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, int(threads))
    size = buffer_bytes or max(4 * l3_bytes(), 64 << 20)
    data = np.ones(size // 8, dtype=np.float64)  # written once: every page is resident
    parts = np.array_split(data, threads)
    best, passes = float("inf"), 0
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        while passes < repeats and (passes == 0 or time.perf_counter() - started < budget_s):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
            passes += 1
    return {"bandwidth_gb_s": data.nbytes / best / 1e9, "buffer_mb": data.nbytes / 2**20, "threads": threads,
            "passes": passes, "method": "numpy float64 sum, best pass"}


# ---------------------------------------------------------------- the roofline

def roofline(weight: Optional[WeightBytes], kv: Optional[KVShape], context_tokens: int,
             bandwidth_gb_s: float, decode_tok_s: Optional[float]) -> dict:
    """The figures a report carries; weight or kv None: 'not known' and no bound."""
    if weight is None or kv is None:
        missing = " and ".join(n for n, v in (("weight bytes", weight), ("KV shape", kv)) if v is None)
        return {"bandwidth_gb_s": bandwidth_gb_s, "bound_tok_s": None, "share": None,
                "weight_bytes_per_token": weight.per_token if weight else None,
                "kv_bytes_per_token": kv.bytes_per_token(context_tokens) if kv else None,
                "context_tokens": context_tokens, "note": f"{missing} {NOT_KNOWN} for this runner"}
    kv_bytes = kv.bytes_per_token(context_tokens)
    per_token = weight.per_token + kv_bytes
    bound = bandwidth_gb_s * 1e9 / per_token
    return {"weight_bytes_per_token": weight.per_token, "weight_bytes_stored": weight.stored,
            "kv_bytes_per_token": kv_bytes, "context_tokens": context_tokens, "kv_shape": asdict(kv),
            "bandwidth_gb_s": bandwidth_gb_s, "bound_tok_s": bound,
            "share": None if decode_tok_s is None else decode_tok_s / bound,
            "counted": weight.counted, "gathered_tables": weight.gathered_tables}


def genai_read_bytes(model_dir: str | Path) -> tuple[WeightBytes, KVShape]:
    """Weights and KV shape of an ONNX Runtime GenAI folder (genai_config.json + its decoder ONNX)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "genai_config.json").read_text())
    onnx_path = model_dir / config["model"]["decoder"].get("filename", "model.onnx")
    dtype = onnx_kv_dtype_bytes(onnx_path) or 4
    return onnx_weight_bytes(onnx_path), kv_shape_from_genai_config(config, dtype)


OV_KV_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "i8": 1}


def openvino_folder_read_bytes(model_dir: str | Path, kv_cache_precision: str = "f32") -> tuple[WeightBytes, KVShape]:
    """Weights and KV shape of an OpenVINO GenAI folder (openvino_model.xml/.bin + config.json)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    return (openvino_weight_bytes(model_dir / "openvino_model.xml"),
            kv_shape_from_hf_config(config, OV_KV_BYTES.get(str(kv_cache_precision).lower(), 4)))


def runner_read_bytes(runner) -> tuple[Optional[WeightBytes], Optional[KVShape]]:
    """What a runner reads per token, where it can say: its `weight_bytes_per_token()` (a WeightBytes)
    and `kv_shape()` (a KVShape); a runner without them whose folder (`runner.dir`) holds an OpenVINO
    GenAI model is read from the folder (KV precision from its `properties`). Otherwise, or on any
    failure: None, and the report says 'not known'."""
    if not hasattr(runner, "weight_bytes_per_token") and hasattr(runner, "dir"):
        folder = Path(runner.dir)
        if (folder / "openvino_model.xml").is_file() and (folder / "config.json").is_file():
            kv_precision = (getattr(runner, "properties", None) or {}).get("KV_CACHE_PRECISION", "f32")
            try:
                return openvino_folder_read_bytes(folder, kv_precision)
            except Exception:
                return None, None
    found: list[Any] = []
    for method in ("weight_bytes_per_token", "kv_shape"):
        try:
            found.append(getattr(runner, method)())
        except Exception:  # AttributeError included: a runner that cannot tell
            found.append(None)
    return found[0], found[1]


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
