"""The modelopt checkpoint engine: a fake-quantized Hugging Face causal LM saved with modelopt's state.

Simulated numerics (weights and activations rounded to the target format, computed in FP32): the
pipeline measures its accuracy; serve/ does not run it (engines/formats.py says so).
"""

from __future__ import annotations

from pathlib import Path


def load_modelopt_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True):
    """The saved fake-quantized model as a causal-LM runner (PyTorch, simulated numerics).

    The .pth file is a torch pickle written by this pipeline and listed with its sha256 in the manifest."""
    import modelopt.torch.opt as mto
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.pytorch.runner import TorchLM

    folder = Path(root) / engine.get("dir", "modelopt")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.float32)
    mto.restore(model, str(folder / "modelopt.pth"))
    return TorchLM(model.eval(), threads)
