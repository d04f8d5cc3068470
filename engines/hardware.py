"""What this machine has: CPU instruction-set features and NVIDIA GPUs, read without importing a runtime.

Engines use it to refuse an artifact the CPU cannot run; the pipeline records it in every manifest.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

# The features that decide which kernels win: VNNI / AMX for INT8, AVX512-BF16 / AMX-BF16 for bf16.
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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


def gpus() -> list[str]:
    """GPU names from nvidia-smi, without importing torch or CUDA."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]
