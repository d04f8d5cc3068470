"""The engine table: every runtime registers its format here, once.

`engines.load_engine`, the memory probe (engines/memprobe.py) and serve/ read this table; nothing
else branches on a format string. A new runtime is one module with a loader plus one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

ONNXRUNTIME = "onnxruntime"
ONNXRUNTIME_GENAI = "onnxruntime-genai"
PYTORCH = "pytorch"
MODELOPT_TORCH = "modelopt-torch"
OPENVINO = "openvino"
OPENVINO_GENAI = "openvino-genai"
TENSORRT_RTX = "tensorrt-rtx"
TORCH_CUDA = "torch-cuda"
COMPRESSED_TENSORS = "compressed-tensors"


@dataclass(frozen=True)
class EngineFormat:
    name: str
    loader: str  # "module:function" taking (root, engine block, threads=, spinning=) and returning a Runner
    # Imported by the memory probe before it reads the idle size, so a runtime's own import is not
    # counted as the model's memory.
    runtime_modules: tuple[str, ...]
    # What serve/ does with it: "encoder" (batched named arrays), "causal_lm" (generation), or None
    # (measured by the pipeline, never served: simulated numerics, or the PyTorch baseline).
    serves: str | None

    def load(self, root, engine: dict, threads: int = 0, spinning: bool = True):
        module, function = self.loader.split(":")
        loader: Callable = getattr(importlib.import_module(module), function)
        return loader(root, engine, threads=threads, spinning=spinning)


FORMATS: dict[str, EngineFormat] = {
    f.name: f
    for f in (
        EngineFormat(ONNXRUNTIME, "engines.onnxruntime_runner:load_ort_runner", ("onnxruntime",), "encoder"),
        EngineFormat(ONNXRUNTIME_GENAI, "engines.genai_runner:load_genai_runner", ("onnxruntime_genai",), "causal_lm"),
        EngineFormat(PYTORCH, "engines.pytorch_runner:load_pytorch_runner", ("torch",), None),
        EngineFormat(MODELOPT_TORCH, "engines.modelopt_runner:load_modelopt_runner", ("torch",), None),
        EngineFormat(OPENVINO, "engines.openvino_runner:load_openvino_runner", ("openvino",), "encoder"),
        EngineFormat(
            OPENVINO_GENAI,
            "engines.openvino_genai_runner:load_ov_genai_runner",
            ("openvino", "openvino_genai"),
            "causal_lm",
        ),
        # A plan built ahead of time for RTX-class GPUs; loading it refuses elsewhere, naming what is missing.
        EngineFormat(TENSORRT_RTX, "engines.tensorrt_rtx_runner:load_rtx_runner", ("tensorrt_rtx",), "encoder"),
        # The pipeline's PyTorch model on one NVIDIA GPU (bf16, FP8 or INT4 Linears); measured, not served.
        EngineFormat(TORCH_CUDA, "engines.torch_cuda_runner:load_torch_cuda_runner", ("torch",), None),
        # A compressed-tensors checkpoint measured in PyTorch (simulated integer numerics); vLLM serves it
        # (python -m optimize.export --to vllm), serve/ does not.
        EngineFormat(COMPRESSED_TENSORS, "engines.compressed_tensors_runner:load_ct_runner", ("torch",), None),
    )
}


class UnknownFormat(KeyError):
    pass


def get(name: str | None) -> EngineFormat:
    try:
        return FORMATS[name or ""]
    except KeyError:
        raise UnknownFormat(f"unknown engine format {name!r} (known: {', '.join(sorted(FORMATS))})") from None
