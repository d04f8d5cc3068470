"""Inputs of a model that takes tensors: the plan of every input from the recipe and the graph (plan),
the encoder that makes batches from data or at random (encoder), and the refusals known before any
stage runs (refusals)."""
