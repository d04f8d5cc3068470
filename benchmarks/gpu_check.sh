#!/usr/bin/env bash
# The torch_cuda engine on a machine with one NVIDIA GPU (bf16, FP8, INT4 on SmolLM2 and MiniLM);
# writes $OUT/report.json and $OUT/gpu_check.log. Refuses with one line, exit 2, where there is no GPU.
# Installs nothing from the network (the device machine has none): the project's own code is run
# from this tree, torch and transformers must already be there, and any wheels carried in
# benchmarks/wheels/ (none are carried today) are installed with pip --no-index.
#
#     OUT=DIR bash benchmarks/gpu_check.sh          (PYTHON=... picks the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-outputs/gpu_check}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "error: benchmarks/gpu_check.sh needs an NVIDIA GPU: nvidia-smi not found" >&2
    exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "error: benchmarks/gpu_check.sh needs an NVIDIA GPU: torch.cuda.is_available() is False for $PY" >&2
    exit 2
fi
mkdir -p "$OUT"

# What the check imports; the rest of the project (hydra-core, onnx, ...) is not needed here.
missing=$("$PY" -c "
import importlib.util
print(' '.join(m for m in ('torch', 'transformers', 'numpy', 'safetensors') if importlib.util.find_spec(m) is None))
")
wheels=$(ls benchmarks/wheels/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
    echo "installing carried wheels (no network): $wheels"
    "$PY" -m pip install --no-index --no-deps $wheels || { echo "error: carried wheels did not install" >&2; exit 2; }
    missing=$("$PY" -c "
import importlib.util
print(' '.join(m for m in ('torch', 'transformers', 'numpy', 'safetensors') if importlib.util.find_spec(m) is None))
")
else
    echo "no wheels carried: using the packages already on this machine"
fi
if [ -n "$missing" ]; then
    echo "error: benchmarks/gpu_check.sh needs $missing, not installed and no network to fetch it" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia_smi.csv"
timeout 540 "$PY" benchmarks/gpu_check.py "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
