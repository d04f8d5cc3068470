"""ONNX Runtime Runner."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.onnxruntime.providers import ProviderFallback

# ONNX element types as numpy dtypes, for feeding inputs the graph accepts.
_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def session_options(threads: int = 0, spinning: bool = True, quiet: bool = False):
    """Spinning worker threads are free speed in a benchmark loop; in a server they take the cores the
    HTTP event loop needs between calls (measured: batch-1 latency doubled on a loaded 2-core machine)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if quiet:  # a caller that reports the failure itself: ONNX Runtime's own log line would repeat it
        options.log_severity_level = 4
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return options


class OrtRunner:
    """Runs an ONNX file with ONNX Runtime; inputs are cast to the dtypes the graph declares."""

    def __init__(
        self,
        model_path: str | Path,
        threads: int = 0,
        providers: list[str] | None = None,
        spinning: bool = True,
        quiet: bool = False,
        cache_root: Path | None = None,
    ):
        import onnxruntime as ort

        from engines.onnxruntime.providers import check_active, provider_options

        self.path = Path(model_path)
        available = ort.get_available_providers()
        asked = list(providers or ["CPUExecutionProvider"])
        # The first provider is the one asked for; the later ones are ONNX Runtime's per-node fallbacks
        # and may be missing. A missing first one is refused, never silently replaced by the next.
        if asked[0] not in available:
            raise ProviderFallback(f"{asked[0]} is not in this onnxruntime (it has {', '.join(available)})")
        chosen = [p for p in asked if p in available]
        self.session = ort.InferenceSession(
            str(self.path),
            session_options(threads, spinning, quiet),
            providers=chosen,
            provider_options=provider_options(chosen, cache_root),
        )
        check_active(self.session, asked[0])
        self.inputs = self.session.get_inputs()
        self.input_names = [i.name for i in self.inputs]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_dtypes = {i.name: _ORT_DTYPES.get(i.type) for i in self.inputs}

    def signature(self) -> list[dict]:
        """Input names, element types and shapes (symbolic dims as strings)."""
        return [{"name": i.name, "type": i.type, "shape": list(i.shape)} for i in self.inputs]

    def output_signature(self) -> list[dict]:
        return [{"name": o.name, "type": o.type, "shape": list(o.shape)} for o in self.session.get_outputs()]

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for name in self.input_names:
            if name not in inputs:
                raise KeyError(f"missing input {name!r} (model takes {self.input_names})")
            dtype = self.input_dtypes.get(name)
            feed[name] = np.asarray(inputs[name], dtype=dtype) if dtype else inputs[name]
        outputs = self.session.run(self.output_names, feed)
        return dict(zip(self.output_names, outputs))


def load_ort_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> OrtRunner:
    """Runner from an engine block: {'format': 'onnxruntime', 'file': NAME, 'providers': [...]}."""
    providers = engine.get("providers")
    try:
        return OrtRunner(
            Path(root) / engine["file"], threads=threads, providers=providers, spinning=spinning, cache_root=Path(root)
        )
    except ProviderFallback as exc:
        from engines.artifact import EngineUnavailable

        raise EngineUnavailable(str(exc)) from None
