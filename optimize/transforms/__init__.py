"""Transforms of a PyTorch model that keep its architecture: layer and projection surgery shared by
prune and distill (surgery.py), and a residual-stream rotation that computes the same function
(rotation.py)."""
