"""ONNX Runtime GenAI: the causal-LM builder and its runners (one generation at a time, and batched)."""
