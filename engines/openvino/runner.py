"""OpenVINO Runner: an IR (model.xml + model.bin) compiled for the CPU device.

An OpenVINO artifact's engine block reads {"format": "openvino", "file": "model.xml",
"inference_precision": "f32" | "bf16", "performance_hint": "LATENCY" | "THROUGHPUT"}. Torch-free:
serve/ loads it through engines.load_engine. Inputs, outputs and signature() follow OrtRunner, so
code written for ONNX Runtime runners works unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.artifact import EngineUnavailable
from engines.hardware import cpu_flags

PRECISIONS = ("f32", "bf16")
PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")

# OpenVINO element type names (ov.Type.get_type_name()) in the spelling OrtRunner.signature() uses.
_ONNX_TYPE_NAMES = {
    "f32": "tensor(float)",
    "f16": "tensor(float16)",
    "bf16": "tensor(bfloat16)",
    "f64": "tensor(double)",
    "i64": "tensor(int64)",
    "i32": "tensor(int32)",
    "i8": "tensor(int8)",
    "u8": "tensor(uint8)",
    "boolean": "tensor(bool)",
}

# The /proc/cpuinfo flags that give the CPU plugin bf16 kernels; either is enough.
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_optimization_capabilities() -> list[str]:
    """What OpenVINO's CPU plugin says it can run natively here ('FP32', 'BF16', 'INT8', ...)."""
    import openvino as ov

    return list(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def missing_cpu_features(precision: str) -> list[str]:
    """The CPU features `precision` needs that this machine lacks (empty: it can run here).

    OpenVINO's own capability list decides: without native bf16 the plugin would not fail but
    silently run in f32, and an artifact measured and gated as bf16 must not be served as something else.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"inference_precision {precision!r}: use one of {PRECISIONS}")
    if precision == "bf16" and "BF16" not in cpu_optimization_capabilities():
        present = [f for f in _BF16_CPU_FLAGS if f in cpu_flags()]
        if present:  # the CPU has it but this OpenVINO build does not use it
            return [f"native bf16 in OpenVINO's CPU plugin (the CPU reports {', '.join(present)})"]
        return [" or ".join(_BF16_CPU_FLAGS)]
    return []


def openvino_missing(packages: dict[str, str], bf16: bool = False) -> str | None:
    """What this machine lacks to build and run an OpenVINO engine, in words (None: nothing).
    `packages` maps the modules needed to their pip names; `bf16` asks for native bf16 compute."""
    import importlib.util

    absent = [pip for module, pip in packages.items() if importlib.util.find_spec(module) is None]
    if absent:
        return f"needs {' and '.join(absent)}: pip install {' '.join(absent)}"
    lacks = missing_cpu_features("bf16") if bf16 else []
    if lacks:
        return f"this CPU has no native bf16 (it lacks {'; '.join(lacks)})"
    return None


def bf16_supported() -> bool:
    return not missing_cpu_features("bf16")


def require_cpu_features(precision: str, what: str = "this model") -> None:
    missing = missing_cpu_features(precision)
    if missing:
        raise EngineUnavailable(
            f"{what} runs OpenVINO in {precision}, which this CPU cannot: it lacks {'; '.join(missing)}"
        )


def compile_properties(threads: int, inference_precision: str, performance_hint: str, spinning: bool) -> dict:
    """CPU plugin properties, all set explicitly.

    The precision is never left to the plugin: on CPUs with native bf16 its default is bf16, so an
    FP32 artifact would quietly run in bf16. OpenVINO has no spin-wait switch (its worker threads
    are TBB's); for servers (`spinning=False`) the closest is to stop pinning those threads to cores,
    so they do not hold the cores the HTTP event loop runs on.
    """
    if performance_hint not in PERFORMANCE_HINTS:
        raise ValueError(f"performance_hint {performance_hint!r}: use one of {PERFORMANCE_HINTS}")
    properties: dict[str, str | int | bool] = {
        "INFERENCE_PRECISION_HINT": inference_precision,
        "PERFORMANCE_HINT": performance_hint,
    }
    if threads > 0:
        properties["INFERENCE_NUM_THREADS"] = threads
    if not spinning:
        properties["ENABLE_CPU_PINNING"] = False
    return properties


def _tensor_name(port) -> str:
    """The ONNX tensor name survives conversion as the port's name; when a port carries several
    (a tensor that is also an output of a merged node), the sorted first is stable across loads."""
    names = sorted(port.get_names())
    if not names:
        raise EngineUnavailable(f"an OpenVINO model port has no tensor name ({port})")
    return names[0]


def _onnx_type_name(element_type) -> str:
    name = element_type.get_type_name()
    return _ONNX_TYPE_NAMES.get(name, f"tensor({name})")


class OpenVINORunner:
    """Runs an OpenVINO IR on the CPU with one infer request, reused call after call (latency path)."""

    def __init__(
        self,
        xml_path: str | Path,
        threads: int = 0,
        inference_precision: str = "f32",
        performance_hint: str = "LATENCY",
        spinning: bool = True,
    ):
        import openvino as ov

        self.path = Path(xml_path)
        if inference_precision not in PRECISIONS:
            raise ValueError(f"inference_precision {inference_precision!r}: use one of {PRECISIONS}")
        self.inference_precision = inference_precision
        self.properties = compile_properties(threads, inference_precision, performance_hint, spinning)
        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(self.path)), "CPU", self.properties)
        self.request = self.compiled.create_infer_request()
        self.inputs = list(self.compiled.inputs)
        self.input_names = [_tensor_name(p) for p in self.inputs]
        self.output_names = [_tensor_name(p) for p in self.compiled.outputs]
        self.input_dtypes = {n: p.get_element_type().to_dtype() for n, p in zip(self.input_names, self.inputs)}

    def signature(self) -> list[dict]:
        """Input names, element types and shapes; dynamic dims as strings ('?', or '1..8' when bounded)."""
        return [
            {
                "name": name,
                "type": _onnx_type_name(port.get_element_type()),
                "shape": [d.get_length() if d.is_static else str(d) for d in port.get_partial_shape()],
            }
            for name, port in zip(self.input_names, self.inputs)
        ]

    def output_signature(self) -> list[dict]:
        return [
            {
                "name": name,
                "type": _onnx_type_name(port.get_element_type()),
                "shape": [d.get_length() if d.is_static else str(d) for d in port.get_partial_shape()],
            }
            for name, port in zip(self.output_names, self.compiled.outputs)
        ]

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for name in self.input_names:
            if name not in inputs:
                raise KeyError(f"missing input {name!r} (model takes {self.input_names})")
            feed[name] = np.ascontiguousarray(inputs[name], dtype=self.input_dtypes[name])
        # share_inputs: the cast arrays are only read during this synchronous call, no need to copy
        # them again. share_outputs=False: results are copies, not views of the request's tensors
        # that the next call overwrites.
        results = self.request.infer(feed, share_inputs=True, share_outputs=False)
        return {name: results[port] for name, port in zip(self.output_names, self.compiled.outputs)}


def load_openvino_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> OpenVINORunner:
    """The Runner of an artifact's {"format": "openvino", ...} engine block; refuses, with the missing
    CPU feature named, a precision this CPU cannot run."""
    precision = engine.get("inference_precision", "f32")
    xml_path = Path(root) / engine["file"]
    require_cpu_features(precision, what=str(xml_path))
    return OpenVINORunner(
        xml_path,
        threads=threads,
        inference_precision=precision,
        performance_hint=engine.get("performance_hint", "LATENCY"),
        spinning=spinning,
    )
