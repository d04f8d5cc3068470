"""Evaluation: one harness for baseline and candidate (harness), output fidelity (fidelity), and the
block-alternating latency benchmark (benchmark)."""
