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
from optimize import artifact, environment, gate, registry, tasks
from optimize.errors import RecipeError
from optimize.evaluate import Subject
from optimize.models import SourceModel, load as load_source, resolve as resolve_source

log = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"


@dataclass
class Model:
    """What flows between stages: a PyTorch module, then engine files in a directory.

    `engine` is the manifest's engine block with paths relative to `engine_dir`; the pipeline
    copies engine_dir's files into the artifact as they are.
    """

    kind: str  # "torch" | "onnx" | "engine" (any other engine directory)
    task: str
    module: Any = None
    engine_dir: Path | None = None
    engine: dict = field(default_factory=dict)
    precision: str = "fp32"

    @property
    def onnx_path(self) -> Path | None:
        return self.engine_dir / self.engine["file"] if self.kind == "onnx" else None

    def with_onnx(self, path: Path, precision: str | None = None) -> "Model":
        """The model as one ONNX file (alone in its directory) for ONNX Runtime."""
        path = Path(path)
        return dataclasses.replace(self, kind="onnx", module=None, engine_dir=path.parent,
                                   engine={"format": "onnxruntime", "file": path.name,
                                           "providers": ["CPUExecutionProvider"]},
                                   precision=precision or self.precision)

    def with_engine(self, engine_dir: Path, engine: dict, precision: str) -> "Model":
        return dataclasses.replace(self, kind="engine", module=None, engine_dir=Path(engine_dir), engine=engine,
                                   precision=precision)


@dataclass
class Plan:
    """The recipe checked and resolved before any weights load."""

    stages: list[tuple[registry.Method, Any]]
    needs_calibration: bool
    final_dir: Path


@dataclass
class Context:
    """What stages and tasks may use: the recipe, a scratch directory, the data, the tokenizer."""

    cfg: Any
    scratch: Path
    source: SourceModel | None = None
    encoder: Any = None
    threads: int = 0
    records: dict = field(default_factory=dict)
    # Generic hooks for stages: files to ship in the artifact ({relative path: file}), and
    # callables that may add to the evaluation's metrics before the gate judges them.
    extra_files: dict = field(default_factory=dict)
    metric_hooks: list = field(default_factory=list)
    _calibration: calibration.TextSet | None = None
    _evaluation: calibration.TextSet | None = None

    def calibration(self) -> calibration.TextSet:
        if self._calibration is None:
            self._calibration = load_data(self.cfg.calibration)
        return self._calibration

    def evaluation_data(self) -> calibration.TextSet:
        """Evaluation items, never overlapping the calibration items (checked by content hash)."""
        if self._evaluation is None:
            data = load_data(self.cfg.evaluate.data)
            if self._calibration is not None:
                try:
                    data = calibration.remove_overlap(self._calibration, data, self.cfg.evaluate.overlap)
                except calibration.DataError as exc:
                    raise RecipeError(str(exc)) from None
            self._evaluation = data
        return self._evaluation

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise RecipeError("this model has no tokenizer: set model.tokenizer=DIR or evaluate.inputs=random")
        return self.encoder(texts)

    def calibration_inputs(self, count: int) -> dict[str, np.ndarray]:
        return self.encode(self.calibration().items[:count])

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
                                field=data_cfg.field, min_chars=data_cfg.min_chars,
                                dataset_split=data_cfg.get("dataset_split"), shape=data_cfg.get("shape"))
    except calibration.DataError as exc:
        raise RecipeError(f"{exc}") from None


def plan(cfg, run_dir: Path) -> Plan:
    """Check the whole recipe before loading weights: methods, parameters, gate, output path, source."""
    tasks.get(cfg.model.task)
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
    if cfg.evaluate.latency and max(cfg.evaluate.batch_sizes) > cfg.evaluate.data.count:
        raise RecipeError(f"evaluate.batch_sizes has {max(cfg.evaluate.batch_sizes)}, more than the "
                          f"{cfg.evaluate.data.count} evaluation samples (evaluate.data.count)")
    if cfg.evaluate.overlap not in ("error", "drop"):
        raise RecipeError(f"evaluate.overlap={cfg.evaluate.overlap} (use error or drop)")
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
    task = tasks.get(cfg.model.task)
    with tempfile.TemporaryDirectory(prefix="optimize-") as scratch, artifact.staging(the_plan.final_dir) as stage:
        ctx = Context(cfg, Path(scratch), threads=cfg.evaluate.threads)
        # Data first: a missing or overlapping data set fails before minutes of model loading.
        if the_plan.needs_calibration:
            ctx.calibration()
        if cfg.evaluate.inputs == "data":
            ctx.evaluation_data()
        source = ctx.source = load_source(cfg.model)
        _prepare_tokenizer(cfg, ctx, source, stage)
        if ctx.encoder is None and hasattr(task, "encoder"):  # tasks whose inputs are not text bring their own
            ctx.encoder = task.encoder(ctx)
        model = _initial_model(source)
        for method, method_cfg in order(the_plan.stages):
            log.info("%s: %s", method.stage, method.name)
            model = method.fn(model, method_cfg, ctx)
        engine = _install_engine(model, stage, cfg)
        _ship_extra_files(ctx, stage)
        baseline = _baseline(ctx, source, task)
        candidate = _candidate(stage, engine, ctx)
        metrics, eval_data = task.evaluate(baseline, candidate, ctx)
        for hook in ctx.metric_hooks:
            hook(metrics)
        metrics["baseline"].update(engine=baseline.engine["format"], precision="fp32")
        metrics["candidate"].update(engine=engine["format"], precision=engine["precision"])
        metrics["threads"] = _threads(ctx.threads)
        verdict = gate.judge(metrics["baseline"], metrics["candidate"], OmegaConf.to_container(cfg.gate))
        manifest = _manifest(cfg, recipe_name, ctx, source, engine, metrics, verdict, eval_data, started)
        manifest = artifact.write_manifest(stage, manifest)
        artifact.publish(stage, the_plan.final_dir)
    return manifest, the_plan.final_dir


def _initial_model(source: SourceModel) -> Model:
    if source.kind == "onnx":
        return Model("torch", source.task).with_onnx(source.onnx_path)
    return Model("torch", source.task, module=source.module)


def _prepare_tokenizer(cfg, ctx: Context, source: SourceModel, stage: Path) -> None:
    """Ship the tokenizer in the artifact and tokenize with that copy: what is measured is what is served."""
    if source.tokenizer_dir is None and source.kind != "hf":
        return
    from transformers import AutoTokenizer

    from engines.text import TextEncoder

    location = str(source.tokenizer_dir) if source.tokenizer_dir else source.location
    AutoTokenizer.from_pretrained(location, gguf_file=source.gguf_file).save_pretrained(str(stage / TOKENIZER_DIR))
    ctx.encoder = TextEncoder(stage / TOKENIZER_DIR, cfg.model.max_length)


def _install_engine(model: Model, stage: Path, cfg) -> dict:
    """Copy the final engine files into the artifact and complete the engine block."""
    if model.engine_dir is None:
        raise RecipeError("the engine stage produced no engine files")
    for path in sorted(model.engine_dir.rglob("*")):
        if path.is_file():
            dest = stage / path.relative_to(model.engine_dir)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    engine = dict(model.engine, precision=model.precision, task=model.task, max_length=cfg.model.max_length,
                  tokenizer=TOKENIZER_DIR if (stage / TOKENIZER_DIR).exists() else None)
    if engine["format"] == "onnxruntime":
        from engines.onnxruntime_runner import OrtRunner

        engine["inputs"] = OrtRunner(stage / engine["file"]).signature()
    return engine


def _ship_extra_files(ctx: Context, stage: Path) -> None:
    for relative, path in ctx.extra_files.items():
        dest = stage / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)


def _engine_bytes(root: Path, engine: dict) -> int:
    """Bytes of the engine's model files (the tokenizer is not counted)."""
    if "file" in engine:
        main = root / engine["file"]
        data = main.with_name(main.name + ".data")
        return main.stat().st_size + (data.stat().st_size if data.exists() else 0)
    folder = root / engine.get("dir", ".")
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and TOKENIZER_DIR not in p.parts)


def _candidate(stage: Path, engine: dict, ctx: Context) -> Subject:
    from engines import load_engine

    return Subject("candidate", load_engine(stage, engine, threads=ctx.threads), engine, stage,
                   _engine_bytes(stage, engine))


def _baseline(ctx: Context, source: SourceModel, task: tasks.Task) -> Subject:
    """The source model as it came, on its own runtime: PyTorch FP32, or ONNX Runtime for an ONNX source."""
    from engines import load_engine

    if source.kind == "onnx":
        engine = {"format": "onnxruntime", "file": source.onnx_path.name}
        root = source.onnx_path.parent
        return Subject("baseline", load_engine(root, engine, ctx.threads), engine, root, _engine_bytes(root, engine))
    from engines.pytorch_runner import TorchRunner

    engine = {"format": "pytorch", "model_dir": source.location, "task": source.task,
              "pooling": ctx.records.get("pooling"), "gguf_file": source.gguf_file,
              "allow_pickle": ctx.cfg.model.allow_pickle}
    runner = TorchRunner(task.module(source.module, ctx), list(task.input_names), list(task.output_names),
                         ctx.threads)
    # Tied weights (an LM head sharing the embedding) appear twice in a state dict: count storage once.
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in source.module.state_dict().values()}
    size = sum(unique.values())
    root = Path(source.location) if Path(source.location).exists() else Path(".")
    return Subject("baseline", runner, engine, root, size)


def _threads(requested: int) -> dict:
    import os

    info = {"requested": requested or "all", "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch_intra_op"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


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
        "evaluation": eval_data,
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
