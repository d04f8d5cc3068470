"""ONNX Runtime: the PyTorch -> ONNX export, graph fusion, execution providers and the ONNX Runtime runner."""
