"""The ONNX Runtime Runner configured for a server process: intra-op threads that sleep when idle.

ONNX Runtime's worker threads spin after each run waiting for more work. In a benchmark loop that
is free speed; in a server the spinning threads take the cores the HTTP event loop needs between
calls, and on a shared 2-core machine they were measured to double batch-1 latency (22.5 ms ->
11.3 ms for MiniLM INT8 without spinning, load average 4). Same graph, same session settings
otherwise, same __call__: the numbers it computes are the ones the pipeline measured.
"""
from __future__ import annotations

from pathlib import Path

from engines.onnxruntime_runner import _ORT_DTYPES, OrtRunner, session_options


class ServingOrtRunner(OrtRunner):
    def __init__(self, model_path: str | Path, threads: int = 0, providers: list[str] | None = None,
                 spinning: bool = False):
        import onnxruntime as ort

        self.path = Path(model_path)
        available = ort.get_available_providers()
        chosen = [p for p in (providers or ["CPUExecutionProvider"]) if p in available]
        if not chosen:
            raise RuntimeError(f"none of the providers {providers} is available here (have {available})")
        options = session_options(threads)
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(self.path), options, providers=chosen)
        self.inputs = self.session.get_inputs()
        self.input_names = [i.name for i in self.inputs]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_dtypes = {i.name: _ORT_DTYPES.get(i.type) for i in self.inputs}


def load_serving_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = False):
    """engines.load for a server: the ServingOrtRunner for ONNX Runtime artifacts."""
    if engine.get("format") != "onnxruntime":
        from engines import load_engine

        return load_engine(root, engine, threads=threads)
    return ServingOrtRunner(root / engine["file"], threads=threads, providers=engine.get("providers"),
                            spinning=spinning)
