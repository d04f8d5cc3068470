"""The pipeline: recipe -> model -> [prune] -> [distill] -> [quantize] -> engine -> evaluate -> gate -> artifact."""
from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

import calibration
from optimize import artifact, environment, gate, registry
from optimize.errors import RecipeError
from optimize.evaluate import Subject, evaluate
from optimize.models import SourceModel, load as load_source, resolve as resolve_source
from optimize.tasks import TASKS

log = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"


@dataclass
class Model:
    """What flows between stages: a PyTorch module, then an ONNX file."""

    kind: str  # "torch" | "onnx"
    task: str
    module: Any = None
    onnx_path: Path | None = None
    precision: str = "fp32"

    def with_onnx(self, path: Path, precision: str | None = None) -> "Model":
        return dataclasses.replace(self, kind="onnx", module=None, onnx_path=Path(path),
                                   precision=precision or self.precision)


@dataclass
class Plan:
    """The recipe checked and resolved before any weights load."""

    stages: list[tuple[registry.Method, Any]]
    needs_calibration: bool
    final_dir: Path


@dataclass
class Context:
    cfg: Any
    scratch: Path
    source: SourceModel | None = None
    encoder: Any = None
    threads: int = 0
    records: dict = field(default_factory=dict)
    _calibration: calibration.TextSet | None = None

    def calibration(self) -> calibration.TextSet:
        if self._calibration is None:
            self._calibration = load_data(self.cfg.calibration)
        return self._calibration

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise RecipeError("this model takes no text: give evaluation inputs with evaluate.inputs=random")
        return self.encoder(texts)

    def calibration_inputs(self, count: int) -> dict[str, np.ndarray]:
        return self.encode(self.calibration().items[:count])

    def task_module(self, model: Model):
        from engines.pytorch_runner import read_pooling, sentence_embedding_module

        if model.task == "sentence_embedding":
            pooling = read_pooling(self.source.tokenizer_dir) if self.source.tokenizer_dir else {"mode": "mean",
                                                                                                "normalize": False}
            self.records["pooling"] = pooling
            return sentence_embedding_module(model.module, pooling)
        raise RecipeError(f"no export wrapper for task {model.task}")

    def record(self, stage: str, info: dict) -> None:
        self.records.setdefault("stages", {})[stage] = info

    def progress(self, items, label: str):
        for i, item in enumerate(items, 1):
            if i == 1 or i % 10 == 0 or i == len(items):
                log.info("%s %d/%d", label, i, len(items))
            yield item


def load_data(data_cfg) -> calibration.TextSet:
    try:
        return calibration.load(data_cfg.source, data_cfg.split, data_cfg.count, data_cfg.seed, path=data_cfg.path,
                                field=data_cfg.field, min_chars=data_cfg.min_chars)
    except calibration.DataError as exc:
        raise RecipeError(f"{exc}") from None


def plan(cfg, run_dir: Path) -> Plan:
    """Check the whole recipe before loading weights: methods, parameters, gate, output path, source."""
    stages = []
    for stage in registry.STAGES:
        section = cfg[stage]
        if section.method in (None, "none"):
            continue
        method = registry.get(stage, section.method)
        params = OmegaConf.to_container(section.params, resolve=True) or {}
        if cfg.model.task not in method.tasks:
            raise RecipeError(f"{stage}.method={method.name} does not support model.task={cfg.model.task}")
        stages.append((method, registry.build_config(method, params)))
    if not any(m.stage == "engine" for m, _ in stages):
        raise RecipeError("engine.method is required (the artifact needs an engine to run on)")
    if not any(cfg.gate[k] is not None for k in gate.gate_keys()):
        raise RecipeError("the gate checks nothing: set at least one gate threshold (for example gate.min_cosine=0.99)")
    if cfg.evaluate.inputs not in ("data", "random"):
        raise RecipeError(f"evaluate.inputs={cfg.evaluate.inputs} (use data or random)")
    if not cfg.evaluate.batch_sizes or min(cfg.evaluate.batch_sizes) < 1:
        raise RecipeError("evaluate.batch_sizes must list batch sizes of at least 1")
    if cfg.model.task not in TASKS and cfg.model.task != "generic":
        raise RecipeError(f"model.task={cfg.model.task} is not supported (known: {', '.join([*TASKS, 'generic'])})")
    resolve_source(cfg.model)
    final = Path(cfg.output_dir).expanduser().resolve() if cfg.output_dir else run_dir / "artifact"
    artifact.check_destination(final, cfg.overwrite)
    return Plan(stages, any(m.needs_calibration for m, _ in stages), final)


def order(stages):
    """Methods that work on the PyTorch module run before the engine; ONNX-level methods after."""
    torch_side = [s for s in stages if s[0].input_format == "torch" and s[0].stage != "engine"]
    engine = [s for s in stages if s[0].stage == "engine"]
    onnx_side = [s for s in stages if s[0].input_format == "onnx"]
    return torch_side + engine + onnx_side


def run(cfg, recipe_name: str, run_dir: Path) -> tuple[dict, Path]:
    """Run the recipe. Returns (manifest, artifact path). Raises RecipeError on bad input."""
    started = time.time()
    the_plan = plan(cfg, run_dir)
    with tempfile.TemporaryDirectory(prefix="optimize-") as scratch, artifact.staging(the_plan.final_dir) as stage:
        ctx = Context(cfg, Path(scratch), threads=cfg.evaluate.threads)
        source = ctx.source = load_source(cfg.model)
        if source.tokenizer_dir is not None or source.kind == "hf":
            _ship_tokenizer(source, stage / TOKENIZER_DIR)
            from engines.text import TextEncoder

            ctx.encoder = TextEncoder(stage / TOKENIZER_DIR, cfg.model.max_length)
        if the_plan.needs_calibration:
            ctx.calibration()
        model = Model("torch" if source.kind == "hf" else "onnx", source.task, module=source.module,
                      onnx_path=source.onnx_path)
        for method, method_cfg in order(the_plan.stages):
            log.info("%s: %s", method.stage, method.name)
            model = method.fn(model, method_cfg, ctx)
        shutil.move(str(model.onnx_path), stage / "model.onnx")
        engine = {"format": "onnxruntime", "file": "model.onnx", "precision": model.precision, "task": source.task,
                  "inputs": _signature(stage / "model.onnx"), "max_length": cfg.model.max_length,
                  "tokenizer": TOKENIZER_DIR if (stage / TOKENIZER_DIR).exists() else None,
                  "providers": ["CPUExecutionProvider"]}
        metrics, eval_data = _evaluate(cfg, ctx, source, stage, engine, the_plan)
        verdict = gate.judge(metrics["baseline"], metrics["candidate"], OmegaConf.to_container(cfg.gate))
        manifest = _manifest(cfg, recipe_name, ctx, source, engine, metrics, verdict, eval_data, started)
        manifest = artifact.write_manifest(stage, manifest)
        artifact.publish(stage, the_plan.final_dir)
    return manifest, the_plan.final_dir


def _ship_tokenizer(source: SourceModel, dest: Path) -> None:
    from transformers import AutoTokenizer

    location = str(source.tokenizer_dir) if source.tokenizer_dir else source.location
    AutoTokenizer.from_pretrained(location, gguf_file=source.gguf_file).save_pretrained(str(dest))


def _signature(path: Path) -> list[dict]:
    from engines.onnxruntime_runner import OrtRunner

    return OrtRunner(path).signature()


def _evaluate(cfg, ctx: Context, source: SourceModel, stage: Path, engine: dict, the_plan: Plan):
    from engines import load_engine

    eval_data = None
    if cfg.evaluate.inputs == "random":
        inputs = random_inputs(_signature(stage / "model.onnx"), cfg.evaluate.data.count, cfg.evaluate.data.seed)
    else:
        eval_data = load_data(cfg.evaluate.data)
        if the_plan.needs_calibration:
            try:
                eval_data = calibration.remove_overlap(ctx.calibration(), eval_data, cfg.evaluate.overlap)
            except calibration.DataError as exc:
                raise RecipeError(str(exc)) from None
        inputs = ctx.encode(eval_data.items)
    baseline = _baseline(cfg, ctx, source)
    candidate = Subject("candidate", load_engine(stage, engine, threads=ctx.threads), engine, stage,
                        (stage / "model.onnx").stat().st_size)
    output = TASKS[source.task].fidelity_output if source.task in TASKS else None
    metrics = evaluate(baseline, candidate, inputs, output, cfg.evaluate, ctx.scratch)
    metrics["baseline"].update(engine=baseline.engine["format"], precision="fp32")
    metrics["candidate"].update(engine="onnxruntime", precision=engine["precision"])
    metrics["threads"] = _threads(ctx.threads)
    return metrics, eval_data


def _baseline(cfg, ctx: Context, source: SourceModel) -> Subject:
    """The source model as it came, on its own runtime: PyTorch FP32, or ONNX Runtime for an ONNX source."""
    from engines import load_engine

    if source.kind == "onnx":
        engine = {"format": "onnxruntime", "file": source.onnx_path.name}
        root = source.onnx_path.parent
        return Subject("baseline", load_engine(root, engine, ctx.threads), engine, root,
                       _weights_bytes(source.onnx_path))
    from engines.pytorch_runner import ENCODER_INPUTS, TorchRunner

    engine = {"format": "pytorch", "model_dir": source.location, "task": source.task,
              "pooling": ctx.records.get("pooling"), "gguf_file": source.gguf_file,
              "allow_pickle": cfg.model.allow_pickle}
    runner = TorchRunner(ctx.task_module(Model("torch", source.task, module=source.module)), ENCODER_INPUTS,
                         list(TASKS[source.task].output_names), ctx.threads)
    size = sum(p.numel() * p.element_size() for p in source.module.state_dict().values())
    return Subject("baseline", runner, engine, Path(source.location) if Path(source.location).exists() else Path("."),
                   size)


def _weights_bytes(onnx_path: Path) -> int:
    data = onnx_path.with_name(onnx_path.name + ".data")
    return onnx_path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def _threads(requested: int) -> dict:
    import os

    import onnxruntime  # noqa: F401

    info = {"requested": requested or "all", "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch_intra_op"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def random_inputs(signature: list[dict], count: int, seed: int, dim: int = 16) -> dict[str, np.ndarray]:
    """Random tensors shaped from an ONNX signature: symbolic batch -> count, other symbolic dims -> dim."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in signature:
        shape = [count if i == 0 and not isinstance(d, int) else (d if isinstance(d, int) else dim)
                 for i, d in enumerate(spec["shape"])]
        if "int" in spec["type"]:
            inputs[spec["name"]] = rng.integers(0, 100, size=shape).astype(np.int64)
        elif "bool" in spec["type"]:
            inputs[spec["name"]] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            inputs[spec["name"]] = rng.standard_normal(shape).astype(np.float32)
    return inputs


def _manifest(cfg, recipe_name, ctx, source, engine, metrics, verdict, eval_data, started) -> dict:
    calib = ctx._calibration.describe() if ctx._calibration else None
    return {
        "id": uuid.uuid4().hex,
        "parent_id": None,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": {"name": recipe_name, "resolved": OmegaConf.to_container(cfg, resolve=True)},
        "model": {"source": cfg.model.source, "resolved": source.location, "task": source.task,
                  "sha256": _source_hash(source), **source.info},
        "calibration": calib,
        "evaluation": eval_data.describe() if eval_data else {"source": "random", "count": cfg.evaluate.data.count,
                                                              "seed": cfg.evaluate.data.seed},
        "engine": engine,
        "stages": ctx.records.get("stages", {}),
        "metrics": metrics,
        "gate": verdict.to_dict(),
        "verdict": "passed" if verdict.passed else "failed",
        "environment": environment.describe(),
        "duration_s": round(time.time() - started, 1),
    }


def _source_hash(source: SourceModel) -> dict:
    """sha256 of the source's weight files (or the ONNX file), by name."""
    from engines.artifact import sha256_file

    path = Path(source.location)
    if source.kind == "onnx":
        return {source.onnx_path.name: sha256_file(source.onnx_path)}
    if source.gguf_file:
        return {source.gguf_file: sha256_file(path / source.gguf_file)}
    if path.is_dir():
        return {p.name: sha256_file(p) for p in sorted(path.glob("*.safetensors"))}
    return {}
