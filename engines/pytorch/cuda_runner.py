"""The torch_cuda engine's runners: the pipeline's Hugging Face model on one NVIDIA GPU in bf16,
its Linears optionally swapped for FP8 or INT4 weight-only ones (engines/pytorch/cuda_quant.py), compiled
with torch.compile mode="reduce-overhead" (CUDA graphs). A causal LM decodes with a static KV cache,
the shape CUDA graphs need, which `generate` compiles on its own with the CompileConfig given here.

The artifact holds the bf16 weights; the FP8/INT4 weights are rebuilt from them at load time
(round-to-nearest, deterministic), so what is loaded is what was measured.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.pytorch.runner import ENCODER_INPUTS, TorchLM, load_hf_model, read_pooling, sentence_embedding_module

FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards


def cuda_missing(precision: str = "bf16") -> str | None:
    """What this machine lacks for the torch_cuda engine at `precision`, in words; None if nothing."""
    import shutil

    import torch

    if torch.version.cuda is None:
        return "a CUDA device (this torch is a CPU-only build)"
    if not torch.cuda.is_available():
        smi = "nvidia-smi not found" if shutil.which("nvidia-smi") is None else "torch sees none"
        return f"a CUDA device ({smi})"
    if precision == "fp8" and torch.cuda.get_device_capability(0) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(0)
        return (
            f"a GPU with FP8 tensor cores (compute capability 8.9+; {name} has {torch.cuda.get_device_capability(0)})"
        )
    return None


def prepare(model, precision: str, group_size: int):
    """The model on the GPU in bf16 with its Linears swapped; returns (model, swap record)."""
    import torch

    from engines.pytorch.cuda_quant import swap_linears

    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    return model, swap_linears(model, precision, group_size)


class CudaEncoder:
    """Named arrays in, named arrays out, for an encoder wrapped by sentence_embedding_module."""

    input_names = list(ENCODER_INPUTS)
    output_names = ["last_hidden_state", "sentence_embedding"]

    def __init__(self, module, compile_mode: str | None):
        import torch

        self.module = torch.compile(module, mode=compile_mode) if compile_mode else module

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        args = [torch.from_numpy(np.ascontiguousarray(inputs[n])).cuda() for n in self.input_names]
        with torch.inference_mode():
            outputs = self.module(*args)
        # .cpu() waits for the GPU, so a caller's wall clock covers the whole call.
        return {n: o.float().cpu().numpy() for n, o in zip(self.output_names, outputs)}


class CudaLM(TorchLM):
    """TorchLM on the GPU: scoring runs eagerly; decoding uses a static cache and CUDA graphs."""

    def __init__(self, model, compile_mode: str | None):
        super().__init__(model)
        if compile_mode:
            from transformers import CompileConfig

            self.model.generation_config.cache_implementation = "static"
            self.model.generation_config.compile_config = CompileConfig(mode=compile_mode, fullgraph=False)

    def _ids(self, ids):
        import torch

        return torch.as_tensor(np.asarray(ids, dtype=np.int64), device="cuda")[None]

    def logits(self, ids) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=self._ids(ids), use_cache=False)
        return out.logits[0].float().cpu().numpy()

    def _generate(self, prompt_ids, new_tokens: int, streamer=None):
        import torch

        ids = self._ids(prompt_ids)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=streamer,
                pad_token_id=self.model.config.eos_token_id,
            )
        return out[0, ids.shape[1] :].tolist()

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        """perf_counter() at each new token, taken after the GPU has finished it."""
        import torch

        from engines.pytorch.runner import token_stamps

        stamps = token_stamps(torch.cuda.synchronize)
        self._generate(prompt_ids, new_tokens, stamps)
        return stamps.times

    def greedy(self, prompt_ids, new_tokens: int) -> list[int]:
        return self._generate(prompt_ids, new_tokens)


def load_torch_cuda_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True):
    """Runner from an engine block: {'format': 'torch-cuda', 'model_dir', 'task', 'precision',
    'group_size', 'compile'}; refuses, naming what is missing, on a machine without a CUDA GPU."""
    missing = cuda_missing(engine.get("precision", "bf16"))
    if missing:
        raise RuntimeError(f"the torch-cuda engine needs {missing}")
    model_dir = Path(engine["model_dir"])
    if not model_dir.is_absolute():
        model_dir = root / model_dir
    task = engine["task"]
    model, _ = prepare(load_hf_model(str(model_dir), task), engine["precision"], int(engine.get("group_size", 128)))
    compile_mode = engine.get("compile") or None
    if task == "causal_lm":
        return CudaLM(model, compile_mode)
    if task == "sentence_embedding":
        pooling = engine.get("pooling") or read_pooling(model_dir)
        return CudaEncoder(sentence_embedding_module(model, pooling), compile_mode)
    raise ValueError(f"no torch-cuda runner for task {task!r}")
