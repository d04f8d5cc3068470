"""The torch_cuda engine's numerics on CPU (torch 2.13 runs torch._scaled_mm on float8 inputs and the
INT4 int4pack kernel on CPU), its plan-time refusal without a CUDA device, and the device script's
refusal on a machine with no GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.pytorch.cuda_quant import (
    Fp8Linear,
    Int4Linear,
    int4_dequantize,
    int4_fits,
    int4_quantize,
    swap_linears,
)

REPO = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available()


def tiny_linear(in_features=128, out_features=64, bias=True):
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias)


def relative_error(got, want) -> float:
    return float((got - want).norm() / want.norm())


def test_fp8_linear_matches_float_within_e4m3_precision():
    linear = tiny_linear()
    x = torch.randn(3, 5, 128)
    want = linear(x)
    got = Fp8Linear(linear)(x)
    assert got.shape == want.shape
    # e4m3 keeps 3 mantissa bits (relative step 1/16 at worst); two roundings average out well below it.
    assert relative_error(got, want) < 0.06
    assert Fp8Linear(linear).weight_fp8.dtype == torch.float8_e4m3fn


def test_fp8_activation_scale_follows_the_input():
    linear = tiny_linear(bias=False)
    small, large = torch.randn(4, 128) * 1e-3, torch.randn(4, 128) * 1e3
    fp8 = Fp8Linear(linear)
    for x in (small, large):  # a fixed scale would flush the first to zero or saturate the second
        assert relative_error(fp8(x), linear(x)) < 0.06


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_its_dequantized_weight_and_the_float_one(group_size):
    linear = tiny_linear()
    x = torch.randn(2, 7, 128)
    codes, scales_and_zeros = int4_quantize(linear.weight, group_size)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    reference = x @ int4_dequantize(codes, scales_and_zeros, group_size).t() + linear.bias
    got = Int4Linear(linear, group_size)(x)
    assert torch.allclose(got, reference, atol=1e-4, rtol=1e-4)  # the kernel computes what the codes say
    # 16 levels per group: error grows with the group; 128 still within a fifth of the output's norm.
    assert relative_error(got, linear(x)) < {32: 0.12, 64: 0.15, 128: 0.2}[group_size]


def test_int4_refuses_shapes_the_kernel_cannot_pack():
    assert "does not divide" in int4_fits(tiny_linear(96, 64), 64)
    assert "divisible by 8" in int4_fits(tiny_linear(128, 20), 32)
    assert int4_fits(tiny_linear(576, 64), 64) is None  # SmolLM2's width takes group 64 (inner tiles 4)


def tiny_llama():
    from tests.support.models import tiny_llama as build

    torch.manual_seed(0)
    # initializer_range 0.2, not 0.02: logits far from uniform, so a broken swap moves the perplexity.
    return build(layers=2, ffn=128, hidden=64, vocab_size=256, max_positions=64, initializer_range=0.2).eval()


def perplexity(model, ids) -> float:
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, :-1]
    return math.exp(float(torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:])))


@pytest.mark.parametrize("precision,group_size,tolerance", [("fp8", 128, 0.02), ("int4", 32, 0.05)])
def test_tiny_llama_with_swapped_linears_keeps_its_perplexity(precision, group_size, tolerance):
    model = tiny_llama()
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, 48))
    base = perplexity(model, ids)
    record = swap_linears(model, precision, group_size)
    assert record["swapped"] and "lm_head" in record["kept"]
    kinds = {type(model.get_submodule(name)) for name in record["swapped"]}
    assert kinds == {Fp8Linear if precision == "fp8" else Int4Linear}
    quantized = perplexity(model, ids)
    assert math.isfinite(quantized)
    assert abs(quantized - base) / base < tolerance


def test_bf16_swaps_nothing():
    model = tiny_llama()
    assert swap_linears(model, "bf16")["swapped"] == []


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_engine_refuses_at_plan_time_naming_the_missing_device():
    from optimize import registry
    from optimize.errors import RecipeError

    method = registry.get("engine", "torch_cuda")
    with pytest.raises(RecipeError) as refused:
        registry.build_config(method, {"precision": "int4", "group_size": 64})
    assert str(refused.value).startswith("engine.method=torch_cuda needs a CUDA device")
    with pytest.raises(RecipeError, match="group_size=48"):
        registry.build_config(method, {"group_size": 48})


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("fake_smi", [False, True], ids=["no nvidia-smi", "nvidia-smi but no CUDA torch"])
def test_gpu_check_script_refuses_without_a_gpu(tmp_path, fake_smi):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    if fake_smi:  # an nvidia-smi on PATH: the refusal must then come from torch.cuda.is_available()
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.parent.mkdir()
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)
        env["PATH"] = f"{smi.parent}:{env['PATH']}"
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "GPU" in lines[0], lines
    assert ("torch.cuda.is_available() is False" in lines[0]) == fake_smi
    assert not (tmp_path / "out").exists()
