"""The engine race (engine.method=auto, registered in optimize/compile/auto.py): build the
candidates that make sense for the model and this machine, measure each with the same harness, and
ship the fastest that passes every accuracy check of the gate.

Which runtime and precision wins depends on the CPU: ONNX Runtime's INT8 GEMM runs at its FP32
speed on AVX2 without VNNI, OpenVINO's bf16 needs AVX512-BF16 or AMX, and oneDNN's kernels behind
OpenVINO pull ahead where AMX exists. So nothing here is chosen in advance: every candidate is
built, scored against the baseline on the evaluation data (the data the gate judges), timed in one
block-alternating benchmark with the baseline, and recorded in the manifest, winners and losers
alike, with the reason each lost. Built candidates are cached by content hash (the model's weights,
the candidate's methods and parameters, the calibration set, the package versions and the CPU), so a
rerun with another gate rebuilds nothing.

candidates: what can be raced and the race's config; build and cache: the candidates built (or
reused); scoring and lm: each candidate measured against the baseline (encoders; causal LMs);
choice: the winner; budget: the build budget; report: the record and the plot; entry: one candidate;
cells: what the report shows of each candidate.
"""
