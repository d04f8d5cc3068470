"""The compressed-tensors checkpoint engine: packed integer weights and their scales in a Hugging Face
folder (what vLLM loads), run here by transformers in FP32 with compressed-tensors' simulated numerics.

The pipeline measures its accuracy; serve/ does not run it (engines/formats.py says so): vLLM does.
"""

from __future__ import annotations

from pathlib import Path


def load_ct_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True):
    """The saved checkpoint as a causal-LM runner: transformers unpacks the integers (compressed-tensors
    installed) and each Linear computes with the dequantized weights, W8A8 rounding its inputs per token."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.pytorch.runner import TorchLM

    folder = Path(root) / engine.get("dir", "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return TorchLM(model.eval(), threads)
