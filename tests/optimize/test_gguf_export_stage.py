"""engine.method=gguf through the real command line: the model written as a GGUF with its Modelfile,
gated and served on that file; a type that cannot be written is one line, exit 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.cli import TINY_LM_RACE, one_error_line, refusal_in_process, run_optimize

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "libgguf", "jinja2")),
    reason="needs gguf, libgguf and jinja2 (pip install 'optimize[llm]')",
)
# recipe=smollm2_laptop names its race's candidates, so one engine method is run from smollm2_int4_cpu.
TINY_STAGE = [
    *TINY_LM_RACE,
    "evaluate.task_params.standard_tasks=[]",
    "evaluate.task_params.fidelity_tokens=512",
    "evaluate.task_params.fidelity_screen_tokens=256",
]


def test_a_type_the_writer_cannot_write_is_one_line(tmp_path):
    proc = refusal_in_process(
        "recipe=smollm2_int4_cpu", "engine=gguf_q4_k_m", "engine.params.type=Q3_K", f"output_dir={tmp_path / 'a'}"
    )
    one_error_line(proc, "engine.params.type='Q3_K' cannot be written", "Q4_K_M")
    assert not (tmp_path / "a").exists()


def test_an_unknown_server_is_one_line(tmp_path):
    proc = refusal_in_process(
        "recipe=smollm2_int4_cpu", "engine=gguf_q8_0", "engine.params.serve_with=vllm", f"output_dir={tmp_path / 'a'}"
    )
    one_error_line(proc, "engine.params.serve_with='vllm'")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from tests.support.models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("hf") / "hf", hidden=256, ffn=512, layers=4)


@pytest.mark.slow
def test_the_artifact_is_the_written_gguf_and_its_modelfile_gated_on_the_file(tiny_folder, tmp_path):
    import gguf

    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={tiny_folder}",
        *TINY_STAGE,
        "engine=gguf_q8_0",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["stages"]["engine"]
    assert record["method"] == "gguf" and record["type"] == "Q8_0" and record["served_by"] == "native_gguf"
    engine_dir = out / manifest["engine"]["dir"]
    reader = gguf.GGUFReader(str(engine_dir / "model.gguf"))
    assert {t.name: t.tensor_type.name for t in reader.tensors} == record["tensor_types"]
    assert (engine_dir / "Modelfile").read_text().startswith("FROM ./model.gguf\n")
    assert manifest["gate"]["checks"], "the gate judged the file"
