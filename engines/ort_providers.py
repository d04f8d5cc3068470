"""ONNX Runtime execution providers: which this machine can run, and what it lacks for the others."""

from __future__ import annotations

GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
PROVIDERS = (*GPU_PROVIDERS, "CPUExecutionProvider")


def missing_for(provider: str) -> list[str]:
    """What this machine lacks to run `provider` (empty: nothing), each as a short phrase."""
    import importlib.util

    import onnxruntime as ort

    from engines.hardware import gpus

    if provider == "CPUExecutionProvider":
        return []
    missing = [] if gpus() else ["an NVIDIA GPU with CUDA (nvidia-smi finds none)"]
    if provider not in ort.get_available_providers():
        missing.append(
            f"onnxruntime with {provider} (install onnxruntime-gpu; this onnxruntime has "
            f"{', '.join(ort.get_available_providers())})"
        )
    if provider == "TensorrtExecutionProvider" and importlib.util.find_spec("tensorrt") is None:
        missing.append("TensorRT (the tensorrt Python package)")
    return missing
