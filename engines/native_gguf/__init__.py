"""The native GGUF engine: a GGUF file's own Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / K-quant blocks decoded by the pipeline's
x86-64 kernels (kernels.c: AVX-512 VNNI, or AVX2), compiled on the machine that runs them (build.py), loaded and
repacked by model.py, served and measured through runner.py."""
