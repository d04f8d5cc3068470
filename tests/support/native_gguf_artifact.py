"""A native-gguf artifact as the engine stage lays one out (optimize/compile/native_gguf.py): the tiny
random Llama of tests.support.models written as a Q8_0 GGUF file, beside its tokenizer files, in the
engine folder, under a manifest that passes verification (signed with `key` where one is given).
Offline, a few seconds (torch and transformers write the file; serving it needs neither)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

ENGINE_DIR = "native_gguf"
GGUF = "tiny.Q8_0.gguf"
CONTEXT = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def native_gguf_artifact(out: Path, key: bytes | None = None) -> Path:
    from engines.artifact import MANIFEST, SCHEMA_VERSION, file_table, seal
    from engines.formats import NATIVE_GGUF
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    artifact = Path(out)
    engine_dir = artifact / ENGINE_DIR
    engine_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_llama_folder(Path(tmp) / "hf", max_positions=CONTEXT)
        write_gguf(source, engine_dir / GGUF, "Q8_0")
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, engine_dir / name)
    engine = {"format": NATIVE_GGUF, "dir": ENGINE_DIR, "gguf": GGUF, "context": CONTEXT, "task": "causal_lm"}
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "id": "tiny-native-gguf-test",
        "parent_id": None,
        "recipe": {"name": "tiny_gguf", "resolved": {}},
        "model": {"source": "random LlamaConfig (tests)", "task": "causal_lm"},
        "engine": engine,
        "gate": {"passed": True, "checks": []},
        "verdict": "passed",
        "files": file_table(artifact),
    }
    (artifact / MANIFEST).write_text(json.dumps(seal(manifest, key), indent=2))
    return artifact
