"""Build a genuinely tiny causal-LM artifact: random-weight Llama (2 layers, width 64, context 256), a
byte-level BPE tokenizer trained on CPython's own docs, a chat template (tests.support.models), converted
by onnxruntime-genai's builder, wrapped in a manifest that passes verification. Offline, about 20 s.
With --openvino, the same model exported as OpenVINO GenAI's stateful IR instead (a few seconds).

    python -m tests.support.tiny_llm OUT_DIR [--openvino]     (from the repository root)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

GENAI_ENGINE = {
    "format": "onnxruntime-genai",
    "dir": "genai",
    "precision": "fp32",
    "task": "causal_lm",
    "tokenizer": "genai",
    "providers": ["CPUExecutionProvider"],
}
OPENVINO_ENGINE = {
    "format": "openvino-genai",
    "dir": "ov",
    "precision": "fp32",
    "inference_precision": "f32",
    "kv_cache_precision": "f32",
    "task": "causal_lm",
    "tokenizer": "ov",
}


def build_in_subprocess(out: Path, *flags: str) -> Path:
    """`python -m tests.support.tiny_llm OUT [FLAGS]` offline, in a process of its own (the builders'
    libraries stay out of the test process); asserts it succeeded and returns OUT."""
    import os

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "tests.support.tiny_llm", str(out), *flags]
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def write_manifest(artifact: Path, engine: dict | None = None) -> None:
    from engines.artifact import MANIFEST, SCHEMA_VERSION, file_table, seal

    manifest = {
        "schema_version": SCHEMA_VERSION,
        "id": "tiny-llm-test",
        "parent_id": None,
        "recipe": {"name": "tiny_llm", "resolved": {"serve": {"max_queue": 8}}},
        "model": {"source": "random LlamaConfig (tests)", "task": "causal_lm"},
        "engine": engine or GENAI_ENGINE,
        "gate": {"passed": True, "checks": []},
        "verdict": "passed",
        "files": file_table(artifact),
    }
    (artifact / MANIFEST).write_text(json.dumps(seal(manifest), indent=2))


def build(out: Path) -> Path:
    from tests.support.models import tiny_llama_folder

    artifact = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_llama_folder(Path(tmp) / "src", max_positions=256)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-i",
                str(source),
                "-m",
                str(source),
                "-o",
                str(artifact / "genai"),
                "-p",
                "fp32",
                "-e",
                "cpu",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    write_manifest(artifact)
    return artifact


def build_openvino(out: Path) -> Path:
    """The same tiny Llama as OpenVINO GenAI's stateful IR (engines.openvino.genai_build), FP32."""
    from engines.openvino.genai_build import export_stateful_lm
    from tests.support.models import tiny_llama_folder

    artifact = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_llama_folder(Path(tmp) / "src", max_positions=256)
        export_stateful_lm(source, artifact / "ov")
    write_manifest(artifact, OPENVINO_ENGINE)
    return artifact


if __name__ == "__main__":
    (build_openvino if "--openvino" in sys.argv[2:] else build)(Path(sys.argv[1]))
