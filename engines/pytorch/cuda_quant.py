"""Quantized Linears on the matmul kernels torch itself ships, no extra package:

- FP8 (`Fp8Linear`): e4m3 weights with one per-tensor scale, activations cast to e4m3 with a scale
  taken from each call's own absolute maximum (dynamic), multiplied by `torch._scaled_mm`. On
  Hopper this is the tensor cores' FP8 path; on CPU torch 2.13 runs the same op (for tests).
- INT4 weight-only (`Int4Linear`): asymmetric 4-bit groups along the input channels (group size
  32, 64 or 128), packed and multiplied by `aten._weight_int4pack_mm` (CUDA, bf16 activations) or
  its `_for_cpu` twin. Activations stay in the model's dtype.

`swap_linears` replaces a model's nn.Linear modules in place and says which it kept, and why.
torch is imported at the top: only the torch_cuda runner and its tests import this module, lazily.
"""

from __future__ import annotations

from typing import Any

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_GROUP_SIZES = (32, 64, 128)
PRECISIONS = ("bf16", "fp8", "int4")


class _QuantLinearBase:
    """Shared shape handling: the kernels take 2-D activations; the model passes [..., in]."""

    in_features: int
    out_features: int

    def _flat(self, x):
        return x.reshape(-1, self.in_features)

    def _unflat(self, y, x):
        return y.reshape(*x.shape[:-1], self.out_features)


def fp8_quantize(tensor) -> tuple[Any, Any]:
    """(e4m3 tensor, float32 per-tensor scale) with tensor ~= e4m3 * scale."""
    amax = tensor.detach().abs().amax().float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    quantized = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def fp8_fits(linear) -> str | None:
    """Why this Linear cannot take the FP8 kernel, or None: cuBLASLt's FP8 GEMM needs both weight
    dims to be multiples of 16."""
    if linear.in_features % 16 or linear.out_features % 16:
        return f"fp8 needs in/out features divisible by 16 ({linear.in_features}x{linear.out_features})"
    return None


def int4_inner_k_tiles(in_features: int) -> int | None:
    """The CUDA packing's innerKTiles (8, 4 or 2): in_features must be a multiple of 16 * tiles."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    return None


def int4_fits(linear, group_size: int) -> str | None:
    """Why this Linear cannot take the INT4 kernel at this group size, or None."""
    if linear.in_features % group_size:
        return f"int4 group {group_size} does not divide in_features {linear.in_features}"
    if int4_inner_k_tiles(linear.in_features) is None:
        return f"int4 packing needs in_features divisible by 32 ({linear.in_features})"
    if linear.out_features % 8:
        return f"int4 packing needs out_features divisible by 8 ({linear.out_features})"
    return None


class Fp8Linear(torch.nn.Module, _QuantLinearBase):
    """y = x W^T + b with W in e4m3 (per-tensor scale) and x cast to e4m3 per call (dynamic scale)."""

    weight_fp8: torch.Tensor  # buffers (register_buffer), which nn.Module's attribute lookup types loosely
    weight_scale: torch.Tensor

    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = fp8_quantize(linear.weight)
        self.register_buffer("weight_fp8", weight.contiguous())
        self.register_buffer("weight_scale", scale.to(linear.weight.device))
        self.bias = linear.bias

    def forward(self, x):
        flat = self._flat(x)
        x8, x_scale = fp8_quantize(flat)
        # _scaled_mm takes the second operand column-major: the transpose of a row-major [out, in].
        y = torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return self._unflat(y, x)


def int4_quantize(weight, group_size: int) -> tuple[Any, Any]:
    """(codes 0..15 as int32 [out, in], scales_and_zeros [in/group, out, 2]) of asymmetric groups, in
    the layout the int4pack kernels read: w ~= (code - 8) * scale + zero, zero the group's midpoint."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-6) / 15
    zero = low + scale * 8
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return codes, scales_and_zeros


def int4_dequantize(codes, scales_and_zeros, group_size: int):
    """The float weight the INT4 codes stand for (the reference the kernel is tested against)."""
    out_features, in_features = codes.shape
    scale = scales_and_zeros[..., 0].transpose(0, 1).unsqueeze(-1)
    zero = scales_and_zeros[..., 1].transpose(0, 1).unsqueeze(-1)
    groups = codes.reshape(out_features, in_features // group_size, group_size).float()
    return ((groups - 8) * scale + zero).reshape(out_features, in_features)


def int4_pack(codes):
    """Codes packed for this device's kernel: CUDA takes two codes per byte (even index high)."""
    tiles = int4_inner_k_tiles(codes.shape[1])
    if codes.device.type == "cuda":
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, tiles)


class Int4Linear(torch.nn.Module, _QuantLinearBase):
    """Weight-only INT4 in groups of group_size input channels; activations in compute_dtype."""

    def __init__(self, linear, group_size: int = 128):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        codes, scales_and_zeros = int4_quantize(linear.weight, group_size)
        # The CUDA kernel computes in bf16 only; the CPU one also in float32.
        cuda = linear.weight.device.type == "cuda"
        self.compute_dtype = torch.bfloat16 if cuda else linear.weight.dtype
        self.register_buffer("weight_int4", int4_pack(codes))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(self.compute_dtype))
        self.bias = linear.bias

    def forward(self, x):
        flat = self._flat(x).to(self.compute_dtype)
        op = (
            torch.ops.aten._weight_int4pack_mm
            if flat.device.type == "cuda"
            else torch.ops.aten._weight_int4pack_mm_for_cpu
        )
        y = op(flat.contiguous(), self.weight_int4, self.group_size, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return self._unflat(y, x)


def swap_linears(model, precision: str, group_size: int = 128, skip: tuple[str, ...] = ("lm_head",)) -> dict:
    """Replace every nn.Linear of `model` (in place) by its FP8 or INT4 version; bf16 swaps nothing.
    Returns {"swapped": [names], "kept": {name: why}} for the manifest."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} (use {', '.join(PRECISIONS)})")
    record: dict = {"precision": precision, "swapped": [], "kept": {}}
    if precision == "bf16":
        return record
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, linear in targets:
        if any(name == s or name.endswith("." + s) for s in skip):
            record["kept"][name] = "kept in the model's dtype (skip list)"
            continue
        why = fp8_fits(linear) if precision == "fp8" else int4_fits(linear, group_size)
        if why:
            record["kept"][name] = why
            continue
        replacement = Fp8Linear(linear) if precision == "fp8" else Int4Linear(linear, group_size)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        record["swapped"].append(name)
    return record
