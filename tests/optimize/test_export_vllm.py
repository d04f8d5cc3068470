"""`python -m optimize.export ARTIFACT --to vllm DIR`: causal-LM artifacts written as the Hugging Face
checkpoint vLLM loads, with their tokenizer and a provenance file; other engines refused with one line.

- compressed-tensors INT8 W8A8 and INT4 W4A16 (recipe smollm2_int8_vllm on a tiny random Llama, ~30 s
  a run): the folder holds the artifact's own integers, each the round-to-nearest of the source
  weight; vLLM's CPU build serves it, answers a completion read with the openai client, and its
  perplexity on the artifact's held-out tokens is within 1% of the artifact's own.
- modelopt FP8 (smollm2_fp8_sim): the folder is modelopt's export; vLLM's CPU build loads it and has
  no FP8 kernel for it, which the server test gives as its skip reason.

vLLM runs in an environment of its own (it pins its own torch and transformers): its interpreter is
found as the benchmarks find it ($PEERS_VLLM_PYTHON, or the `vllm` on PATH). The server tests skip
without it, and on a CPU without AVX-512 (vLLM's CPU kernels die there with SIGILL)."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import ROOT, one_error_line, run_optimize


def _vllm_python() -> tuple[Path | None, str]:
    from benchmarks.serve_llm_load import vllm_python

    return vllm_python(None)


VLLM_PYTHON, VLLM_WHY = _vllm_python()
TINY_RUN = (
    "model.hub_id=null",
    "model.max_length=128",
    "evaluate.data.count=4",
    "calibration.count=4",
    "evaluate.task_params.perplexity_tokens=256",
    "evaluate.task_params.perplexity_window=128",
    "evaluate.task_params.lm_eval_tasks=[]",
    "gate.max_lm_eval_drop=null",
    "gate.max_ppl_increase_pct=1000",  # random weights: the tests are about the checkpoint, not quality
)


def pipeline_artifact(work: Path, source: Path, *overrides: str) -> Path:
    out = work / "artifact"
    proc = run_optimize(
        *overrides, f"model.source={source}", *TINY_RUN, f"output_dir={out}", f"hydra.run.dir={work / 'run'}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def export(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimize.export", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


def exported(artifact: Path, dest: Path, quantization: str) -> Path:
    proc = export(artifact, "--to", "vllm", dest)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"vllm: {dest} (") and f", {quantization}); serve: vllm serve {dest}" in proc.stdout
    return dest


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    """A 2-layer random Llama with 32-wide heads (vLLM's CPU attention takes head sizes from 32) and the
    small BPE tokenizer: every Linear is a multiple of 32 wide, as vLLM's CPU INT4 kernel needs."""
    from tests.support.models import tiny_llama, train_tokenizer

    out = tmp_path_factory.mktemp("llama32") / "src"
    vocab = train_tokenizer(out)
    model = tiny_llama(layers=2, ffn=128, hidden=64, vocab_size=vocab, max_positions=256, head_dim=32)
    model.config.bos_token_id = model.config.eos_token_id = model.config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def w8a8_artifact(tiny_source, tmp_path_factory) -> Path:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the [vllm] extra)")
    return pipeline_artifact(tmp_path_factory.mktemp("w8a8"), tiny_source, "recipe=smollm2_int8_vllm")


@pytest.fixture(scope="module")
def w8a8_dir(w8a8_artifact, tmp_path_factory) -> Path:
    return exported(w8a8_artifact, tmp_path_factory.mktemp("vllm-w8a8") / "model", "W8A8")


def source_weights(source: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(source / "model.safetensors"))


def test_w8a8_folder_holds_the_artifacts_integers_and_its_tokenizer(w8a8_dir, w8a8_artifact, tiny_source):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    quantization = json.loads((w8a8_dir / "config.json").read_text())["quantization_config"]
    assert (quantization["quant_method"], quantization["format"]) == ("compressed-tensors", "int-quantized")
    assert quantization["ignore"] == ["lm_head"]
    scheme = quantization["config_groups"]["group_0"]
    assert (scheme["weights"]["num_bits"], scheme["weights"]["strategy"]) == (8, "channel")
    assert (scheme["input_activations"]["strategy"], scheme["input_activations"]["dynamic"]) == ("token", True)
    weights, source = load_file(str(w8a8_dir / "model.safetensors")), source_weights(tiny_source)
    name = "model.layers.1.mlp.down_proj"
    q, scale = weights[f"{name}.weight"], weights[f"{name}.weight_scale"]
    assert q.dtype == torch.int8 and scale.shape == (q.shape[0], 1)
    original = source[f"{name}.weight"].float()
    assert torch.equal(scale[:, 0], original.abs().amax(1) / 127.5)  # compressed-tensors' symmetric range
    assert torch.equal(q, torch.round(original / scale).clamp(-128, 127).to(torch.int8))  # round to nearest
    # The artifact's own checkpoint, byte for byte: what the pipeline measured is what vLLM gets.
    assert (w8a8_dir / "model.safetensors").read_bytes() == (
        w8a8_artifact / "checkpoint/model.safetensors"
    ).read_bytes()
    assert AutoConfig.from_pretrained(str(w8a8_dir)).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(str(w8a8_dir))
    assert tokenizer.decode(tokenizer("def parse(path):")["input_ids"]) == "def parse(path):"
    provenance = json.loads((w8a8_dir / "optimize_export.json").read_text())
    manifest = json.loads((w8a8_artifact / "manifest.json").read_text())
    assert provenance["source_id"] == manifest["id"] and provenance["quantization"] == "W8A8"
    assert provenance["measured"] == {
        "engine": "compressed-tensors",
        "simulated": True,
        "perplexity": manifest["evaluation"]["perplexity"],
    }
    for entry in provenance["files"]:
        assert hashlib.sha256((w8a8_dir / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
    assert {e["path"] for e in provenance["files"]} | {"optimize_export.json"} == {p.name for p in w8a8_dir.iterdir()}


def test_w4a16_folder_packs_int4_groups_of_the_source_weights(tiny_source, tmp_path):
    import torch
    from safetensors.torch import load_file

    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the [vllm] extra)")
    artifact = pipeline_artifact(
        tmp_path,
        tiny_source,
        "recipe=smollm2_int8_vllm",
        "quantize=ct_int4_w4a16",
        "quantize.params.group_size=32",
    )
    folder = exported(artifact, tmp_path / "vllm", "W4A16")
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == "pack-quantized"
    weights = quantization["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, True)
    tensors, name = load_file(str(folder / "model.safetensors")), "model.layers.0.mlp.down_proj"
    packed, scale = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
    assert packed.dtype == torch.int32 and packed.shape == (64, 128 // 8)  # eight 4-bit values per int32
    assert scale.shape == (64, 128 // 32) and f"{name}.weight" not in tensors
    groups = source_weights(tiny_source)[f"{name}.weight"].float().reshape(64, 4, 32)
    assert torch.equal(scale, groups.abs().amax(-1) / 7.5)  # compressed-tensors' symmetric range [-8, 7]
    # Unpacked (low nibble first, offset by 8), the integers are the round-to-nearest of the source weights.
    nibbles = torch.stack([(packed >> (4 * k)) & 0xF for k in range(8)], dim=-1).reshape(64, 128) - 8
    expected = torch.round(groups / scale[..., None]).clamp(-8, 7).reshape(64, 128)
    assert torch.equal(nibbles, expected.to(nibbles.dtype))


def test_the_checkpoint_engine_needs_a_compressed_tensors_method_before_it(tiny_source, tmp_path):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the [vllm] extra)")
    out = tmp_path / "artifact"
    proc = run_optimize(
        "recipe=smollm2_int8_vllm",
        "quantize=none",
        f"model.source={tiny_source}",
        *TINY_RUN,
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_error_line(proc, "engine.method=compressed_tensors_checkpoint needs a ct_* quantize method before it")
    assert not out.exists()


def test_refusals_are_one_line_and_write_nothing(w8a8_artifact, w8a8_dir, minilm_artifact, tmp_path):
    one_error_line(export(w8a8_artifact, "--to", "onnx", tmp_path / "a"), "--to onnx: the formats written are: vllm")
    one_error_line(export(w8a8_artifact), "give one of --bundle DIR or --to vllm DIR")
    one_error_line(export(w8a8_artifact, "--to", "vllm", w8a8_dir), "already exists and is not empty")
    one_error_line(export(w8a8_dir, "--to", "vllm", tmp_path / "b"))  # not an artifact
    one_error_line(
        export(w8a8_artifact, "--bundle", tmp_path / "c", "--to", "vllm", tmp_path / "d"),
        "give one of --bundle DIR or --to vllm DIR",
    )
    one_error_line(
        export(minilm_artifact, "--to", "vllm", tmp_path / "e"),
        "'onnxruntime' 'sentence_embedding' engine holds no checkpoint vLLM loads",
    )
    assert list(tmp_path.iterdir()) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_missing() -> str | None:
    """Why vLLM's CPU server cannot run here, in words; None when it can."""
    from engines.hardware import cpu_flags

    if VLLM_PYTHON is None:
        return VLLM_WHY
    if "avx512f" not in cpu_flags():
        return "vLLM's CPU kernels need AVX-512 (they die with SIGILL on this CPU)"
    return None


class Server:
    """`vllm serve FOLDER` on a free loopback port, its log in `log`; stopped on exit."""

    def __init__(self, folder: Path, log: Path):
        from optimize.export.vllm import serve_command, serving_dtype

        self.folder, self.log, self.port = folder, log, free_port()
        dtype = serving_dtype(json.loads((folder / "optimize_export.json").read_text())["quantization"])
        self.command = serve_command(VLLM_PYTHON, folder, self.port, max_model_len=256, dtype=dtype)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "Server":
        with self.log.open("w") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, cwd=self.log.parent)
        deadline = time.time() + 600
        while time.time() < deadline and self.process.poll() is None and "startup complete" not in self.text():
            time.sleep(2)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.mark.slow
def test_vllm_serves_the_w8a8_folder_at_the_artifacts_perplexity(w8a8_dir, w8a8_artifact, tmp_path):
    from openai import OpenAI

    from optimize.export.vllm import perplexity_ids, served_perplexity

    missing = vllm_missing()
    if missing:
        pytest.skip(missing)
    with Server(w8a8_dir, tmp_path / "vllm.log") as server:
        assert "startup complete" in server.text(), server.text()[-3000:]
        assert "CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8" in server.text()  # vLLM's INT8 GEMM
        client = OpenAI(base_url=server.base_url, api_key="none")
        reply = client.completions.create(model=str(w8a8_dir), prompt="def parse(path):", max_tokens=8, temperature=0)
        assert reply.choices[0].text and reply.usage.completion_tokens == 8
        manifest = json.loads((w8a8_artifact / "manifest.json").read_text())
        ids, window = perplexity_ids(w8a8_artifact, manifest)
        served = served_perplexity(server.base_url, str(w8a8_dir), ids, window)
    own = manifest["metrics"]["candidate"]["perplexity"]
    assert abs(served / own - 1) < 0.01, (served, own)


@pytest.fixture(scope="module")
def fp8_artifact(tmp_path_factory) -> Path:
    from tests.support.models import tiny_llama_folder

    pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed")
    work = tmp_path_factory.mktemp("fp8")
    return pipeline_artifact(work, tiny_llama_folder(work / "src", max_positions=256), "recipe=smollm2_fp8_sim")


@pytest.fixture(scope="module")
def fp8_dir(fp8_artifact, tmp_path_factory) -> Path:
    return exported(fp8_artifact, tmp_path_factory.mktemp("vllm-fp8") / "model", "FP8")


def test_the_fp8_folder_is_modelopts_checkpoint_with_its_tokenizer(fp8_dir, fp8_artifact):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "FP8"
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as weights:
        dtypes = {name: str(weights.get_tensor(name).dtype) for name in weights.keys()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "torch.float8_e4m3fn"
    assert any(name.endswith("weight_scale") for name in dtypes) and any(
        name.endswith("input_scale") for name in dtypes
    )
    tokenizer = AutoTokenizer.from_pretrained(str(fp8_dir))
    assert tokenizer.decode(tokenizer("def parse(path):")["input_ids"]) == "def parse(path):"
    provenance = json.loads((fp8_dir / "optimize_export.json").read_text())
    source = json.loads((fp8_artifact / "manifest.json").read_text())
    assert provenance["source_id"] == source["id"] and provenance["measured"]["simulated"] is True
    for entry in provenance["files"]:
        assert hashlib.sha256((fp8_dir / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]


@pytest.mark.slow
def test_vllm_loads_the_fp8_folder(fp8_dir, tmp_path):
    missing = vllm_missing()
    if missing:
        pytest.skip(missing)
    with Server(fp8_dir, tmp_path / "vllm.log") as server:
        text = server.text()
        if server.process.poll() is not None:
            assert "Loading weights took" in text, text[-3000:]  # vLLM read the checkpoint before it stopped
            if "static_scaled_fp8_quant" in text:
                pytest.skip("vLLM's CPU build loaded the FP8 checkpoint and has no FP8 kernel; serve it on a GPU")
            raise AssertionError(text[-3000:])
        assert "startup complete" in text, text[-3000:]
