"""Tensor datatypes by their three names: ONNX Runtime's (what a graph declares), numpy's (what the
server computes with) and KServe v2's (what the metadata routes and inference requests say). The
models describe their tensors with them and the KServe protocol parses requests with them."""

from __future__ import annotations

import numpy as np

# KServe v2 datatypes this server can read, as little-endian numpy dtypes (the binary extension
# sends raw little-endian bytes). BYTES is left out: the served graphs take no string tensors.
KSERVE_DTYPES = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
NUMPY_TO_KSERVE = {dtype: name for name, dtype in KSERVE_DTYPES.items()}

ORT_TO_NUMPY = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}
