"""The environment a run measured on, recorded in every manifest."""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from importlib import metadata

PACKAGES = ("optimize", "torch", "transformers", "onnx", "onnxruntime", "onnxscript", "numpy", "hydra-core",
            "tokenizers", "safetensors", "nvidia-modelopt", "tensorrt", "onnxruntime-genai")
_CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_vnni() -> bool:
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def gpus() -> list[str]:
    """GPU names from nvidia-smi, without importing torch or CUDA."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def describe() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(),
                "features": sorted(f for f in _CPU_FEATURES if f in cpu_flags())},
        "gpus": gpus(),
        "packages": package_versions(),
    }
