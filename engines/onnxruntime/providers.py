"""ONNX Runtime execution providers: which this machine can run, what it lacks for the others, and
whether a session really runs on the one it was asked for.

onnxruntime-gpu on a machine without a usable GPU (or without TensorRT's libraries) lists the CUDA
and TensorRT providers as available, creates the session, and runs it on the CPU without an error:
only session.get_providers() tells. `check_active` turns that silent fallback into a refusal.
"""

from __future__ import annotations

from pathlib import Path

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


# Inside an artifact: the TensorRT provider's engines and timing cache, built on the first session
# (during the pipeline's run, so the manifest lists them) and read by every later one on that GPU.
TENSORRT_CACHE_DIR = "trt_cache"


class ProviderFallback(RuntimeError):
    """A session runs on another provider than the one asked for; the message is one line."""


def check_active(session, asked: str) -> None:
    """Refuse a session whose first active provider is not `asked` (ONNX Runtime fell back)."""
    active = session.get_providers()
    if not active or active[0] != asked:
        raise ProviderFallback(
            f"ONNX Runtime was asked for {asked} and runs on {active[0] if active else 'no provider'} instead "
            f"(active: {', '.join(active) or 'none'}): "
            + ("; ".join(missing_for(asked)) or "the provider failed to start")
        )


def provider_options(providers: list[str], root: Path | None) -> list[dict]:
    """Options per provider: the TensorRT provider's engine and timing caches in root/trt_cache."""
    options: list[dict] = []
    for provider in providers:
        if provider == "TensorrtExecutionProvider" and root is not None:
            cache = str(Path(root) / TENSORRT_CACHE_DIR)
            options.append(
                {
                    "trt_engine_cache_enable": "True",
                    "trt_engine_cache_path": cache,
                    "trt_timing_cache_enable": "True",
                    "trt_timing_cache_path": cache,
                }
            )
        else:
            options.append({})
    return options
