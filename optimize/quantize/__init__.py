"""Quantize methods (quantize.method=...), on the ONNX graph or the PyTorch model, one or more per module."""
