"""Measurements beside the gate: this project's artifacts against their peers (llama.cpp, Optimum, vLLM,
the same model on other runtimes) and the server under load, each `python -m benchmarks.NAME`."""
