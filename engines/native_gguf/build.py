"""Compiling the native GGUF kernels on the machine that runs them.

kernels.c is built with -march=native, so the library is this CPU's (its AVX-512 VNNI path where the
CPU has it, else its AVX2 one): it is cached under a key of the source, the compiler, the target and
the CPU's flags, and a CPU with neither is refused before anything is compiled, naming what it lacks.
$OPTIMIZE_NATIVE_MARCH sets another -march (x86-64-v3: the AVX2 path on any AVX2 CPU).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from engines.cache import cache_root
from engines.hardware import cpu_flags

SOURCE = Path(__file__).with_name("kernels.c")
# /proc/cpuinfo's names for what each of kernels.c's paths uses: 512-bit integer and float vectors with
# VNNI's u8 x s8 dot products, or 256-bit ones with FMA; f16 conversions in both.
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "f16c")
AVX2_FLAGS = ("avx2", "fma", "f16c")
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]


class NativeBuildError(RuntimeError):
    """The kernels cannot be built or run here (one line: the CPU, the compiler, or its error)."""


def unsupported_cpu(flags: frozenset[str] | None = None, machine: str | None = None) -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return f"the native GGUF kernels are x86-64 AVX-512 code; this machine is {machine}"
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in AVX2_FLAGS if f not in flags]
    if missing:
        return f"the native GGUF kernels need AVX2 with FMA and F16C; this CPU lacks {', '.join(missing)}"
    return None


def path(flags: frozenset[str] | None = None) -> str:
    """Which of the kernels' paths this CPU runs (where nothing else is asked for)."""
    flags = cpu_flags() if flags is None else flags
    return "AVX-512 VNNI" if all(f in flags for f in VNNI_FLAGS) else "AVX2"


def march() -> str:
    return os.environ.get("OPTIMIZE_NATIVE_MARCH") or "native"


def unavailable() -> str | None:
    """Why the kernels cannot be built here (the CPU, or no C compiler), or None."""
    if reason := unsupported_cpu():
        return reason
    try:
        compiler()
    except NativeBuildError as exc:
        return str(exc)
    return None


def compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise NativeBuildError("the native GGUF kernels need a C compiler with OpenMP (install gcc, or set $CC)")
    return found


def library() -> Path:
    """The kernels' shared library for this CPU, compiled once into the cache."""
    reason = unsupported_cpu()
    if reason:
        raise NativeBuildError(reason)
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(SOURCE.read_bytes())
    flags = [*FLAGS, f"-march={march()}"]
    key.update(repr((cc, version, flags, sorted(cpu_flags()))).encode())
    built = cache_root() / "native-gguf" / key.hexdigest()[:16] / "libnative_gguf.so"
    if built.is_file():
        return built
    built.parent.mkdir(parents=True, exist_ok=True)
    partial = built.with_name(f"{built.name}.{os.getpid()}.partial")
    done = subprocess.run([cc, *flags, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        lines = done.stderr.strip().splitlines() or ["no output"]
        said = next((line for line in lines if "error" in line), lines[-1])  # the compiler's error, not its notes
        raise NativeBuildError(f"compiling the native GGUF kernels with {cc} failed: {said[:200]}")
    partial.replace(built)  # whole or not at all: a cut compile leaves nothing to reuse
    return built
