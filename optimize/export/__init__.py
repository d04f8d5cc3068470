"""Exporters: an artifact written for somewhere else to run it, checked against what the pipeline
measured (an edge bundle and the vLLM folder, `python -m optimize.export`; a causal LM as one GGUF
file, `python -m optimize.export.gguf`)."""
