"""Prune methods (prune.method=...): sparsity and structured pruning of the PyTorch model."""
