"""How a bundle runs an encoder's graph: texts tokenized as the pipeline's TextEncoder does, and
the graph on ONNX Runtime or OpenVINO on the CPU, each returning one named output.

run.py loads this file by its path once every file of the bundle matched the manifest (it is in
the bundle's file table); it imports numpy, and a runtime and tokenizers when they are used.
"""

from pathlib import Path

import numpy as np

DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


class Tokens:
    """Texts to int64 input_ids / attention_mask / token_type_ids, as the pipeline's TextEncoder makes them."""

    def __init__(self, folder: Path, max_length: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length)
        pad_id = self.tokenizer.token_to_id("[PAD]")
        self.tokenizer.enable_padding(pad_id=pad_id if pad_id is not None else 0)

    def __call__(self, texts: list[str]) -> dict[str, np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }


def onnxruntime_model(path: Path, threads: int, output: str):
    """ONNX Runtime on the CPU, all graph optimizations (an ORT-format file loads the same way)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = [(i.name, DTYPES.get(i.type, np.int64)) for i in session.get_inputs()]

    def run(feed: dict[str, np.ndarray]) -> np.ndarray:
        return session.run([output], {name: feed[name].astype(dtype) for name, dtype in inputs})[0]

    return run


def openvino_model(path: Path, engine: dict, threads: int, output_name: str):
    """OpenVINO on the CPU with the precision the artifact was evaluated in (never the plugin's default,
    which is bf16 on CPUs that have it)."""
    import openvino as ov

    properties: dict = {
        "INFERENCE_PRECISION_HINT": engine.get("inference_precision", "f32"),
        "PERFORMANCE_HINT": engine.get("performance_hint", "LATENCY"),
    }
    if threads:
        properties["INFERENCE_NUM_THREADS"] = threads
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", properties)
    request = compiled.create_infer_request()
    # The ONNX tensor names survive conversion as port names (sorted first when a port has several).
    inputs = [(sorted(p.get_names())[0], p) for p in compiled.inputs]
    output = next(p for p in compiled.outputs if output_name in p.get_names())

    def run(feed: dict[str, np.ndarray]) -> np.ndarray:
        arrays = {name: np.ascontiguousarray(feed[name], dtype=p.get_element_type().to_dtype()) for name, p in inputs}
        return request.infer(arrays, share_outputs=False)[output]

    return run
