"""TensorRT-RTX plan Runner: a plan built ahead of time (engines/tensorrt_rtx/build.py) run on an
RTX-class NVIDIA GPU, with device memory from cuda-python's CUDA runtime bindings.

This file needs only the standard library and numpy until a plan loads (tensorrt_rtx and cuda-python
are imported then), so an RTX edge bundle carries it as it is. Without an RTX-class GPU, the wheel
or cuda-python, loading refuses with one line naming what is missing.

TensorRT-RTX compiles its kernels for the GPU it finds when the plan first runs; the runtime cache
keeps them between processes. It is written outside the artifact (an artifact's files are fixed by
its manifest), under $XDG_CACHE_HOME/optimize-tensorrt-rtx, one file per plan digest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

# The GPUs TensorRT-RTX runs on: Turing, Ampere, Ada and Blackwell consumer/workstation parts
# (compute capability as nvidia-smi prints it). Hopper and datacenter Blackwell are not among them.
RTX_COMPUTE_CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "12.0")


class Unavailable(RuntimeError):
    """This machine cannot run the plan; the message is one line naming what is missing."""


def gpu_compute_capabilities() -> list[tuple[str, str]]:
    """(name, compute capability) of each NVIDIA GPU nvidia-smi lists; empty without one."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.rsplit(",", 1) for line in out.stdout.splitlines() if "," in line]
    return [(name.strip(), cap.strip()) for name, cap in rows]


def missing() -> list[str]:
    """What this machine lacks to run a TensorRT-RTX plan (empty: nothing), each a short phrase."""
    lacking = []
    if importlib.util.find_spec("tensorrt_rtx") is None:
        lacking.append("TensorRT-RTX (the tensorrt-rtx wheel)")
    if importlib.util.find_spec("cuda") is None:
        lacking.append("cuda-python (the CUDA runtime bindings)")
    found = gpu_compute_capabilities()
    if not found:
        lacking.append("an RTX-class NVIDIA GPU (nvidia-smi finds none)")
    elif not any(cap in RTX_COMPUTE_CAPABILITIES for _, cap in found):
        have = ", ".join(f"{name} (compute capability {cap})" for name, cap in found)
        lacking.append(
            f"an RTX-class NVIDIA GPU (compute capability {', '.join(RTX_COMPUTE_CAPABILITIES)}); "
            f"this machine has {have}"
        )
    return lacking


def _cudart():
    try:
        from cuda.bindings import runtime
    except ImportError:  # cuda-python before 12.6 spelled it cuda.cudart
        from cuda import cudart as runtime  # type: ignore[no-redef]
    return runtime


def _ok(result):
    """cuda-python returns (error, *values): raise on an error, return the values."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise RuntimeError(f"CUDA error {error}")
    return values[0] if len(values) == 1 else values


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "optimize-tensorrt-rtx"


class RtxPlanRunner:
    """Runs a TensorRT-RTX plan on the GPU; named numpy arrays in and out, like every Runner."""

    def __init__(self, plan_path: str | Path, cache_dir: Path | None = None):
        lacking = missing()
        if lacking:
            raise Unavailable("a TensorRT-RTX plan needs " + "; ".join(lacking))
        import tensorrt_rtx as trt

        self.trt, self.cudart = trt, _cudart()
        self.path = Path(plan_path)
        blob = self.path.read_bytes()
        self.cache_path = (cache_dir or default_cache_dir()) / f"{hashlib.sha256(blob).hexdigest()[:32]}.bin"
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise Unavailable(f"TensorRT-RTX could not load {self.path.name} on this GPU (see its log above)")
        self.config = self.engine.create_runtime_config()
        self.cache = self.config.create_runtime_cache()
        if self.cache_path.is_file():
            self.cache.deserialize(self.cache_path.read_bytes())
        self.config.set_runtime_cache(self.cache)
        self.context = self.engine.create_execution_context(self.config)
        self.stream = _ok(self.cudart.cudaStreamCreate())
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.input_names = [n for n in names if is_input[n]]
        self.output_names = [n for n in names if not is_input[n]]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self.buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes), grown on demand
        self.profile: int | None = None
        self.cache_saved = False

    def signature(self) -> list[dict]:
        return [
            {"name": n, "type": str(self.dtypes[n]), "shape": list(self.engine.get_tensor_shape(n))}
            for n in self.input_names
        ]

    def _profile_for(self, shapes: dict[str, tuple]) -> int:
        for index in range(self.engine.num_optimization_profiles):
            ranges = {n: self.engine.get_tensor_profile_shape(n, index) for n in self.input_names}
            if all(
                len(shapes[n]) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shapes[n], hi))
                for n, (lo, _, hi) in ranges.items()
            ):
                return index
        raise ValueError(f"input shapes {shapes} are outside every optimization profile of {self.path.name}")

    def _device(self, name: str, nbytes: int) -> int:
        pointer, size = self.buffers.get(name, (0, 0))
        if size < nbytes:
            if pointer:
                _ok(self.cudart.cudaFree(pointer))
            pointer, size = int(_ok(self.cudart.cudaMalloc(max(nbytes, 1)))), nbytes
            self.buffers[name] = (pointer, size)
        return pointer

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cudart, to_device = self.cudart, self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        arrays = {}
        for name in self.input_names:
            if name not in inputs:
                raise KeyError(f"missing input {name!r} (the plan takes {self.input_names})")
            arrays[name] = np.ascontiguousarray(inputs[name], dtype=self.dtypes[name])
        profile = self._profile_for({n: a.shape for n, a in arrays.items()})
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, int(self.stream))
            self.profile = profile
        for name, array in arrays.items():
            pointer = self._device(name, array.nbytes)
            _ok(cudart.cudaMemcpy(pointer, array.ctypes.data, array.nbytes, to_device))
            self.context.set_input_shape(name, array.shape)
            self.context.set_tensor_address(name, pointer)
        outputs = {}
        for name in self.output_names:
            outputs[name] = np.empty(tuple(self.context.get_tensor_shape(name)), dtype=self.dtypes[name])
            self.context.set_tensor_address(name, self._device(name, outputs[name].nbytes))
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError(f"TensorRT-RTX failed to run {self.path.name}")
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name, array in outputs.items():
            _ok(cudart.cudaMemcpyAsync(array.ctypes.data, self.buffers[name][0], array.nbytes, to_host, self.stream))
        _ok(cudart.cudaStreamSynchronize(self.stream))
        if not self.cache_saved:  # the kernels compiled on the first run, kept for the next process
            self.save_runtime_cache()
        return outputs

    def save_runtime_cache(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.cache_path.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(bytes(self.cache.serialize()))
        os.replace(partial, self.cache_path)  # whole or absent: two processes may share the folder
        self.cache_saved = True


def load_rtx_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> RtxPlanRunner:
    """Runner from an engine block: {'format': 'tensorrt-rtx', 'file': 'model.plan', ...}."""
    try:
        return RtxPlanRunner(Path(root) / engine["file"])
    except Unavailable as exc:
        from engines.artifact import EngineUnavailable

        raise EngineUnavailable(str(exc)) from None
