"""Which type each tensor of a GGUF file gets, by llama.cpp's rules for the file types written
(llama.cpp's src/llama-quant.cpp, for dense models other than Falcon).


- 1-D tensors, norms and biases stay F32;
- the output matrix, and the token embedding where it is also the output (tied), get Q6_K unless the
  file type's base is Q8_0 (then Q8_0), or Q8_0 where its rows do not fill the base type's blocks;
- Q4_K_M / Q5_K_M: attn_v and ffn_down get Q6_K in the layers that "use more bits" (the first and
  last eighth, and every third layer between), the rest the base (Q4_K / Q5_K);
- Q4_0 with an importance matrix: ffn_down of the first eighth of the layers Q4_1;
- a row width the type's blocks do not divide falls back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0,
  and to F16 where even that does not divide it (SmolLM2-135M's width 576 is 2.25 K-quant blocks of
  256, so its Q4_K_M file is mostly Q5_0 with Q4_K and Q6_K in ffn_down).
"""

from __future__ import annotations

from optimize.export.gguf import check_file_type

BASE = {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K"}
BLOCK = {"F32": 1, "F16": 1, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32}
BLOCK.update({"Q4_K": 256, "Q5_K": 256, "Q6_K": 256})
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's layers that get more bits in the _M mixes."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def quantized(name: str, shape: tuple) -> bool:
    """Matrices named *.weight, norms excepted; everything else stays F32."""
    return len(shape) >= 2 and name.endswith(".weight") and "_norm.weight" not in name


def layer_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def tensor_types(file_type: str, shapes: dict, layers: int, has_imatrix: bool = False) -> dict:
    """{GGUF tensor name: type} for a file of `file_type`; `shapes` maps names to numpy shapes
    (rows, columns), in file order."""
    base = BASE[check_file_type(file_type)]
    tied = "output.weight" not in shapes
    types = {}
    for name, shape in shapes.items():
        if not quantized(name, shape):
            types[name] = "F32"
            continue
        chosen = _chosen(name, shape, file_type, base, layers, tied, has_imatrix)
        types[name] = fallback(chosen, shape[-1])
    return types


def _chosen(name, shape, file_type, base, layers, tied, has_imatrix) -> str:
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if shape[-1] % BLOCK[base]:
            return "Q8_0"
        return base if base == "Q8_0" else "Q6_K"
    layer = layer_of(name)
    if file_type in ("Q4_K_M", "Q5_K_M") and name.endswith((".attn_v.weight", ".ffn_down.weight")):
        return "Q6_K" if use_more_bits(layer, layers) else base
    if file_type == "Q4_0" and has_imatrix and name.endswith(".ffn_down.weight") and layer < layers // 8:
        return "Q4_1"  # llama.cpp's guard for the first ffn_down layers with an imatrix
    return base


def fallback(chosen: str, columns: int) -> str:
    """llama.cpp's type for rows of `columns` values that `chosen`'s blocks do not divide."""
    if columns % BLOCK[chosen] == 0:
        return chosen
    smaller = FALLBACK.get(chosen, chosen)
    return smaller if columns % BLOCK[smaller] == 0 else "F16"
