"""The engine table: every runtime registers its format here, once.

`engines.load_engine`, the memory probe (engines/memprobe.py) and serve/ read this table; nothing
else branches on a format string. A new runtime is one module with a loader plus one row here; a
generating one implements engines/generation.py's Generator, and its row says how serve batches it.
"""

from __future__ import annotations

import importlib
import typing
from dataclasses import dataclass
from typing import Callable, Literal

ONNXRUNTIME = "onnxruntime"
ONNXRUNTIME_GENAI = "onnxruntime-genai"
PYTORCH = "pytorch"
MODELOPT_TORCH = "modelopt-torch"
OPENVINO = "openvino"
OPENVINO_GENAI = "openvino-genai"
TENSORRT_RTX = "tensorrt-rtx"
TORCH_CUDA = "torch-cuda"
COMPRESSED_TENSORS = "compressed-tensors"
NATIVE_GGUF = "native-gguf"

# Seeds an engine's Python binding takes (it raises on anything else: a 500 otherwise). ONNX Runtime
# GenAI's random_seed is a signed 32-bit integer whose -1 means "seed from the clock", so negative seeds
# are refused there; OpenVINO GenAI's rng_seed is an unsigned 64-bit integer.
INT31_SEEDS = (0, 2**31 - 1)
UINT64_SEEDS = (0, 2**64 - 1)


@dataclass(frozen=True)
class Package:
    """A Python package a format's engine imports when it serves: the module, and the PyPI
    distributions that install it (the first is the CPU build serve/Dockerfile.cpu installs; a CUDA
    build of the same module may follow)."""

    module: str
    dists: tuple[str, ...]


ORT_GENAI = Package("onnxruntime_genai", ("onnxruntime-genai", "onnxruntime-genai-cuda"))
OPENVINO_RUNTIME = Package("openvino", ("openvino",))
OPENVINO_GENAI_PACKAGES = (
    OPENVINO_RUNTIME,
    Package("openvino_genai", ("openvino-genai",)),
    Package("openvino_tokenizers", ("openvino-tokenizers",)),  # the tokenizer IR's operations
)
# The native engine reads the file with `gguf` and renders the model's chat template with jinja2 itself.
NATIVE_GGUF_PACKAGES = (Package("gguf", ("gguf",)), Package("jinja2", ("jinja2",)))
# It compiles kernels.c on its first load (-fopenmp, against the C library's headers) and runs it with
# libgomp: what a Debian image installs for that.
NATIVE_GGUF_DEBIAN = ("gcc", "libc6-dev", "libgomp1")


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
    # Generating formats (serves="causal_lm"): how serve runs several requests at once. "continuous":
    # requests join and leave the running batch at every step; "static": a batch takes no request once
    # it runs; "none": one generation at a time. batch_loader ("module:function", taking (root, engine
    # block, engines.generation.BatchSettings, threads=, spinning=) and returning a BatchEngine) is
    # required unless batching is "none".
    batching: Literal["continuous", "static", "none"] = "none"
    batch_loader: str | None = None
    seed_range: tuple[int, int] = INT31_SEEDS  # the seeds a request may ask for
    # The platform name KServe v2 / Triton clients read in the model's metadata and configuration
    # (Triton's own names where it has one); None: the format's name.
    kserve_platform: str | None = None
    # What serving it needs beyond the base install and the serve extra (pyproject.toml): the Python
    # packages its engine imports, the Debian packages an image installs for it, a check of this
    # machine ("module:function" returning why it cannot run here, or None), and whether it runs
    # only on an NVIDIA GPU (the CPU image does not carry it). The serving images install these
    # (tests/serve/test_serving_image.py derives their package lists from here), and `python -m serve`
    # refuses an artifact whose format lacks them before it loads anything (serving_unavailable).
    serve_packages: tuple[Package, ...] = ()
    serve_debian: tuple[str, ...] = ()
    serve_check: str | None = None
    gpu_only: bool = False

    def serving_unavailable(self) -> str | None:
        """Why this machine cannot serve the format, in one line naming the format and what is missing,
        or None. Each package is imported (not only looked up): one that is installed but cannot load
        its native library is missing too."""
        for package in self.serve_packages:
            try:
                importlib.import_module(package.module)
            except (ImportError, OSError) as exc:
                said = " ".join(str(exc).split())[:200]
                return (
                    f"engine format {self.name!r} needs the Python package {' or '.join(package.dists)}, "
                    f"which this environment cannot import ({said}); install it, or serve this artifact "
                    f"from an image built with it (docs/deploy.md)"
                )
        reason = _function(self.serve_check)() if self.serve_check else None
        if reason:
            return f"engine format {self.name!r} cannot run on this machine: {reason}"
        return None

    @property
    def platform(self) -> str:
        return self.kserve_platform or self.name

    def loaded_class(self) -> type:
        """The class its loader returns (its return annotation): the one-at-a-time engine."""
        return _returned_class(self.loader)

    def batch_class(self) -> type | None:
        """The class its batch loader returns, or None where it has none."""
        return _returned_class(self.batch_loader) if self.batch_loader else None

    @property
    def constrains_output(self) -> bool:
        """Whether it can serve constrained output (a JSON schema, a regex, a forced tool call): a
        generating format whose every engine class, batched and one at a time, declares it honours
        a constraint (`honours`, engines/generation.py). Read from the classes, so it cannot drift
        from what the server does with the request."""
        if self.serves != "causal_lm":
            return False
        classes = [self.loaded_class(), self.batch_class()]
        return all("constraint" in getattr(cls, "honours", ()) for cls in classes if cls is not None)

    def load(self, root, engine: dict, threads: int = 0, spinning: bool = True):
        return _function(self.loader)(root, engine, threads=threads, spinning=spinning)

    def load_batch_engine(self, root, engine: dict, settings, threads: int = 0, spinning: bool = True):
        if self.batch_loader is None:
            raise ValueError(f"engine format {self.name!r} has no batching engine")
        return _function(self.batch_loader)(root, engine, settings, threads=threads, spinning=spinning)


def _function(path: str) -> Callable:
    module, function = path.split(":")
    return getattr(importlib.import_module(module), function)


def _returned_class(path: str) -> type:
    return typing.get_type_hints(_function(path))["return"]


FORMATS: dict[str, EngineFormat] = {
    f.name: f
    for f in (
        EngineFormat(
            ONNXRUNTIME,
            "engines.onnxruntime.runner:load_ort_runner",
            ("onnxruntime",),
            "encoder",
            kserve_platform="onnxruntime_onnx",
        ),
        # On a CPU model (no PagedAttention) its Engine batches statically
        # (engines/onnxruntime_genai/runner.py says why).
        EngineFormat(
            ONNXRUNTIME_GENAI,
            "engines.onnxruntime_genai.runner:load_genai_runner",
            ("onnxruntime_genai",),
            "causal_lm",
            batching="static",
            batch_loader="engines.onnxruntime_genai.batch:load_genai_batch_engine",
            seed_range=INT31_SEEDS,
            kserve_platform="onnxruntime_genai",
            serve_packages=(ORT_GENAI,),
        ),
        EngineFormat(PYTORCH, "engines.pytorch.runner:load_pytorch_runner", ("torch",), None),
        EngineFormat(MODELOPT_TORCH, "engines.pytorch.modelopt_runner:load_modelopt_runner", ("torch",), None),
        EngineFormat(
            OPENVINO,
            "engines.openvino.runner:load_openvino_runner",
            ("openvino",),
            "encoder",
            serve_packages=(OPENVINO_RUNTIME,),
        ),
        EngineFormat(
            OPENVINO_GENAI,
            "engines.openvino.genai_runner:load_ov_genai_runner",
            ("openvino", "openvino_genai"),
            "causal_lm",
            batching="continuous",
            batch_loader="engines.openvino.genai_batch:load_ov_genai_batch_engine",
            seed_range=UINT64_SEEDS,
            serve_packages=OPENVINO_GENAI_PACKAGES,
        ),
        # A GGUF file's own blocks in the pipeline's AVX-512 VNNI kernels (engines/native_gguf); one
        # sequence at a time. Its check: an x86-64 CPU with AVX2, and a C compiler.
        EngineFormat(
            NATIVE_GGUF,
            "engines.native_gguf.runner:load_native_gguf_runner",
            (),
            "causal_lm",
            serve_packages=NATIVE_GGUF_PACKAGES,
            serve_debian=NATIVE_GGUF_DEBIAN,
            serve_check="engines.native_gguf.build:unavailable",
        ),
        # A plan built ahead of time for RTX-class GPUs; loading it refuses elsewhere, naming what is missing.
        EngineFormat(
            TENSORRT_RTX,
            "engines.tensorrt_rtx.runner:load_rtx_runner",
            ("tensorrt_rtx",),
            "encoder",
            serve_packages=(Package("tensorrt_rtx", ("tensorrt-rtx",)), Package("cuda", ("cuda-python",))),
            gpu_only=True,
        ),
        # The pipeline's PyTorch model on one NVIDIA GPU (bf16, FP8 or INT4 Linears); measured, not served.
        EngineFormat(TORCH_CUDA, "engines.pytorch.cuda_runner:load_torch_cuda_runner", ("torch",), None),
        # A compressed-tensors checkpoint measured in PyTorch (simulated integer numerics); vLLM serves it
        # (python -m optimize.export --to vllm), serve/ does not.
        EngineFormat(COMPRESSED_TENSORS, "engines.pytorch.compressed_tensors_runner:load_ct_runner", ("torch",), None),
    )
}


class UnknownFormat(KeyError):
    pass


def constraining() -> list[str]:
    """The formats that can serve constrained output, by name."""
    return [f.name for f in FORMATS.values() if f.constrains_output]


def get(name: str | None) -> EngineFormat:
    try:
        return FORMATS[name or ""]
    except KeyError:
        raise UnknownFormat(f"unknown engine format {name!r} (known: {', '.join(sorted(FORMATS))})") from None
