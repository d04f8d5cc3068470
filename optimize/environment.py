"""The environment a run measured on, recorded in every manifest."""

from __future__ import annotations

import os
import platform
from importlib import metadata

from engines.hardware import CPU_FEATURES, cpu_flags, gpus

PACKAGES = (
    "optimize",
    "torch",
    "transformers",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "numpy",
    "hydra-core",
    "tokenizers",
    "safetensors",
    "nvidia-modelopt",
    "tensorrt",
    "onnxruntime-genai",
    "openvino",
    "nncf",
    "openvino-genai",
    "openvino-tokenizers",
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def describe() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {
            "model": cpu_model(),
            "cores": os.cpu_count(),
            "features": sorted(f for f in CPU_FEATURES if f in cpu_flags()),
        },
        "gpus": gpus(),
        "packages": package_versions(),
    }


def benchmark_machine(packages: tuple[str, ...]) -> dict:
    """What a benchmark report names its figures by: date, CPU model, cores, CPU features, versions."""
    import datetime

    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "flags": [f for f in CPU_FEATURES if f in cpu_flags()],
        "packages": package_versions(packages),
    }
