"""The pipeline: recipe -> model -> [prune] -> [distill] -> [quantize] -> engine -> evaluate -> gate -> artifact."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from engines import load_engine
from engines.runners import TensorRunner
from optimize import artifact, environment, gate, publish, registry, runlog, tasks, workload
from optimize import plan as plans
from optimize import stages as memory_stages
from optimize.config import recipe_dict
from optimize.context import Context, Model, SourceModel
from optimize.errors import RecipeError
from optimize.evaluate import subjects
from optimize.plan import Plan
from optimize.reports import ci
from optimize.sources.models import load as load_source
from optimize.sources.models import resolve as resolve_source
from optimize.sources.models import source_hash
from optimize.tasks import lm_served

log = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"


def plan(cfg, run_dir: Path) -> Plan:
    """Check the whole recipe before loading weights (methods, parameters, gate, output path, source)
    and resolve it into the plan the run reads."""
    task = tasks.get(cfg.model.task)
    stages = []
    for stage in registry.STAGES:
        section = cfg[stage]
        if section.method in (None, "none"):
            continue
        method = registry.get(stage, section.method)
        params = recipe_dict(section.params)
        if not method.supports(task):
            raise RecipeError(f"{stage}.method={method.name} does not support model.task={cfg.model.task}")
        stages.append((method, registry.build_config(method, dict(params))))
    _refuse_after_candidates(stages)
    if not any(m.stage == "engine" for m, _ in stages):
        raise RecipeError("engine.method is required (the artifact needs an engine to run on)")
    the_gate = plans.GateSettings.of(cfg.gate)
    if not any(the_gate[k] is not None for k in gate.gate_keys()) and not lm_served.asked(the_gate):
        raise RecipeError("the gate checks nothing: set at least one gate threshold (for example gate.min_cosine=0.99)")
    if cfg.evaluate.inputs not in ("data", "random"):
        raise RecipeError(f"evaluate.inputs={cfg.evaluate.inputs} (use data or random)")
    if not cfg.evaluate.batch_sizes or min(cfg.evaluate.batch_sizes) < 1:
        raise RecipeError("evaluate.batch_sizes must list batch sizes of at least 1")
    if cfg.evaluate.latency and max(cfg.evaluate.batch_sizes) > cfg.evaluate.data.count:
        raise RecipeError(
            f"evaluate.batch_sizes has {max(cfg.evaluate.batch_sizes)}, more than the "
            f"{cfg.evaluate.data.count} evaluation samples (evaluate.data.count)"
        )
    the_workload = workload.resolve(cfg, generates=task.generates)
    largest = max(p.batch for p in the_workload.batches)
    if not task.generates and cfg.evaluate.latency and largest > cfg.evaluate.data.count:
        raise RecipeError(
            f"workload.batches has {largest}, more than the {cfg.evaluate.data.count} evaluation samples "
            "(evaluate.data.count)"
        )
    final = Path(cfg.output_dir).expanduser().resolve() if cfg.output_dir else run_dir / "artifact"
    the_plan = plans.resolve(cfg, task, stages, the_workload, the_gate, final)
    _refuse_unconstrained_engine(the_plan)
    lm_served.check_plan(the_plan)
    if cfg.evaluate.overlap not in ("error", "drop"):
        raise RecipeError(f"evaluate.overlap={cfg.evaluate.overlap} (use error or drop)")
    _plan_memory(cfg, task, the_plan)
    publish.check_settings(cfg.publish)
    artifact.check_destination(final, cfg.overwrite)
    ci.check_destination(cfg.report.junit)
    return the_plan


def _plan_memory(cfg, task, run_plan):
    """Each stage's peak memory planned from the source's files before anything loads (optimize/memory):
    a run that cannot fit here is refused in one line; None where the source's size cannot be read
    without loading it (a hub id, an ONNX graph)."""
    from optimize.memory import plan as memory
    from optimize.memory import shape as shapes

    kind, path = resolve_source(cfg.model)
    gguf_file = cfg.model.get("gguf_file")
    if path is not None and gguf_file and path.is_dir():
        kind, path = "gguf", path / gguf_file
    found = shapes.of_source(kind, path)
    if found is None:
        return None
    workload = run_plan.workload if task.generates else None
    the_plan = memory.make(found, _planned_builds(task, run_plan.stages, kind, found), workload=workload)
    memory.check_run(the_plan)
    return the_plan


def _planned_builds(task, stages, kind: str, shape) -> list:
    """The engine builds the run will make: the race's candidates (the default set cut to the model's
    size), or the recipe's one engine method."""
    from optimize.compile.race.candidates import EngineRaceConfig, default_candidates
    from optimize.memory import plan as memory

    method, config = next((m, c) for m, c in stages if m.stage == "engine")
    # Only the race builds from a candidate list; tensorrt_rtx builds its own variants of one engine.
    if not isinstance(config, EngineRaceConfig):
        return [memory.Build(method.name, method.name, {})]

    names = config.candidates or default_candidates(task.generates, kind == "gguf", shape.parameters)
    builds = [memory.Build.of(name, config.spec(name)) for name in names]
    return builds if config.candidates else memory.cheapest_builds(builds, shape.parameters)


def _refuse_after_candidates(stages) -> None:
    engine = next((m for m, _ in stages if m.stage == "engine"), None)
    onnx_side = [m for m, _ in stages if m.input_format == "onnx" and m.stage != "engine"]
    if engine is not None and engine.builds_candidates and onnx_side:
        raise RecipeError(
            f"engine.method={engine.name} builds its own quantized candidates, and "
            f"{onnx_side[0].stage}.method={onnx_side[0].name} works on the ONNX graph after the engine: "
            f"set {onnx_side[0].stage}=none"
        )


def _refuse_unconstrained_engine(the_plan: Plan) -> None:
    """serve.structured_output=true: refuse an engine method none of whose engine formats can
    constrain output (a race builds only its candidates that can, optimize/compile/race/budget.py)."""
    if not the_plan.serve.structured_output:
        return
    from engines import formats

    method, config = next((m, c) for m, c in the_plan.stages if m.stage == "engine")
    made = method.formats(config, the_plan.task)
    if not any(formats.get(name).constrains_output for name in made):
        built = " or ".join(made) if made else "engines of no declared format"
        raise RecipeError(
            f"serve.structured_output=true: engine.method={method.name} builds {built}, which cannot "
            f"constrain output (engine formats that can: {', '.join(formats.constraining())})"
        )


def order(stages):
    """Methods that work on the PyTorch module run before the engine; ONNX-level methods after."""
    torch_side = [s for s in stages if s[0].input_format == "torch" and s[0].stage != "engine"]
    engine = [s for s in stages if s[0].stage == "engine"]
    onnx_side = [s for s in stages if s[0].input_format == "onnx" and s[0].stage != "engine"]
    return torch_side + engine + onnx_side


def run(cfg, recipe_name: str, run_dir: Path) -> tuple[dict, Path]:
    """Run the recipe. Returns (manifest, artifact path). Raises RecipeError on bad input."""
    started = time.time()
    the_plan = plan(cfg, run_dir)
    task = the_plan.task
    memory_plan = _plan_memory(cfg, task, the_plan)
    if memory_plan is not None:
        for line in memory_plan.lines():  # the run's log and -v; a refusal says its own figures
            log.debug("%s", line)
    # Scratch lives in the hidden partial directory beside the artifact (so one removal cleans both,
    # and a run killed with SIGKILL leaves one directory that the next run removes); libraries that
    # ask tempfile for a folder get one inside it too.
    with (
        memory_stages.running() as stages_log,
        artifact.staging(the_plan.final_dir) as stage,
        _temp_inside(artifact.scratch_for(stage)) as scratch,
    ):
        ctx = Context(the_plan, scratch, threads=the_plan.evaluate.threads)
        # Data first: a missing or overlapping data set fails before minutes of model loading.
        with memory_stages.stage("data"):
            if the_plan.needs_calibration:
                ctx.calibration()
            if the_plan.evaluate.inputs == "data":
                ctx.evaluation_data()
        with memory_stages.stage("load"):
            source = ctx.source = load_source(cfg.model)
            _prepare_tokenizer(the_plan, ctx, source, stage)
            task.check_source(ctx)
        if ctx.encoder is None:  # tasks whose inputs are not text bring their own
            ctx.encoder = task.encoder(ctx)
        if ctx.encoder is None and source.onnx_path is not None:  # an ONNX file that takes tensors
            from optimize.inputs.encoder import TensorEncoder

            tensor_encoder = TensorEncoder.for_onnx(source.onnx_path, dict(the_plan.model.inputs), ctx.threads)
            ctx.encoder = tensor_encoder
            ctx.stage_records["inputs"] = tensor_encoder.record()
            from optimize.inputs.refusals import plan_time_refusals

            plan_time_refusals(ctx, the_plan.stages, source.onnx_path)
        task.check_workload(ctx, the_plan.workload)
        lm_served.check_context(the_plan, ctx)
        with memory_stages.stage("baseline"):
            baseline = ctx.baseline = subjects.baseline(ctx, task)
        model = _initial_model(source)
        for method, method_cfg in order(the_plan.stages):
            log.info("%s: %s", method.stage, method.name)
            with memory_stages.stage(f"{method.stage}: {method.name}"):
                model = method.fn(model, method_cfg, ctx).file_into(ctx.stage_records, method.stage)
        with memory_stages.stage("evaluate"):
            engine, runner = _install_engine(model, stage, the_plan, ctx.threads)
            _ship_extra_files({**task.files(ctx), **model.files}, stage)
            candidate = subjects.candidate(stage, engine, runner, model.layer_precision)
            metrics, eval_data = task.evaluate(baseline, candidate, ctx)
        for hook in model.metric_hooks:
            hook(metrics)
        metrics["baseline"].update(
            engine=baseline.engine["format"], precision="fp32", reference=subjects.reference(source)
        )
        metrics["candidate"].update(engine=engine["format"], precision=engine["precision"])
        metrics["threads"] = _threads(ctx.threads)
        metrics["workload"] = the_plan.workload.record()
        verdict = gate.judge(metrics["baseline"], metrics["candidate"], the_plan.gate, the_plan.workload)
        if lm_served.asked(the_plan.gate):
            draft = _manifest(cfg, recipe_name, ctx, source, engine, metrics, verdict, eval_data, started, stage)
            with memory_stages.stage("served gate"):
                verdict = _judge_served(the_plan, ctx, stage, draft)
        manifest = _manifest(cfg, recipe_name, ctx, source, engine, metrics, verdict, eval_data, started, stage)
        manifest["resources"] = _resources(memory_plan, stages_log)
        ci.write_into(stage, manifest, the_plan.final_dir)  # listed in the manifest like every file
        runlog.write_into(stage)
        manifest = artifact.write_manifest(stage, manifest)
        artifact.publish(stage, the_plan.final_dir)
    return manifest, the_plan.final_dir


def _resources(memory_plan, stages_log) -> dict:
    """Memory as planned before loading and each stage's time and peak as run (the run and its children)."""
    return {
        "memory_plan": memory_plan.record() if memory_plan is not None else None,
        "stages": stages_log.record(),
        "peak_gb": round(stages_log.peak.peak / 1e9, 2),
    }


def _judge_served(the_plan: Plan, ctx: Context, stage: Path, draft: dict) -> gate.Verdict:
    """Serve the staged candidate, drive the served load, and judge again with what its clients saw.
    The server reads the artifact as it will ship, so the manifest (the verdict so far) is written
    first; the final one replaces it."""
    artifact.write_manifest(stage, draft)
    metrics = draft["metrics"]
    served = lm_served.measure(stage, ctx, lm_served.settings(the_plan.gate, the_plan.workload))
    metrics["candidate"]["served"] = served
    metrics["table"] = [*metrics.get("table", []), *lm_served.table_rows(served)]
    return gate.judge(metrics["baseline"], metrics["candidate"], the_plan.gate, the_plan.workload)


@contextlib.contextmanager
def _temp_inside(scratch: Path):
    """tempfile's default folder set to `scratch` for the run, then restored."""
    previous = tempfile.tempdir
    tempfile.tempdir = str(scratch)
    try:
        yield scratch
    finally:
        tempfile.tempdir = previous


def _initial_model(source: SourceModel) -> Model:
    if source.onnx_path is not None:
        return Model("torch", source.task).with_onnx(source.onnx_path)
    return Model("torch", source.task, module=source.module)


def _prepare_tokenizer(the_plan: Plan, ctx: Context, source: SourceModel, stage: Path) -> None:
    """Ship the tokenizer in the artifact and tokenize with that copy: what is measured is what is served."""
    if source.tokenizer_dir is None and source.kind != "hf":
        return
    from transformers import AutoTokenizer

    from engines.text import TextEncoder

    location = str(source.tokenizer_dir) if source.tokenizer_dir else source.location
    AutoTokenizer.from_pretrained(location, gguf_file=source.gguf_file).save_pretrained(str(stage / TOKENIZER_DIR))
    ctx.encoder = TextEncoder(stage / TOKENIZER_DIR, the_plan.model.max_length)


def _install_engine(model: Model, stage: Path, the_plan: Plan, threads: int) -> tuple[dict, TensorRunner]:
    """Copy the final engine files into the artifact and complete the engine block. Returns it with
    its runner, loaded from the artifact's copy: the final evaluation measures the files that ship."""
    if model.engine_dir is None:
        raise RecipeError("the engine stage produced no engine files")
    for path in sorted(model.engine_dir.rglob("*")):
        if path.is_symlink() or not (path.is_dir() or path.is_file()):
            raise RecipeError(f"the engine stage left {path.name}, which is not a regular file; refused")
        if path.is_file():
            dest = stage / path.relative_to(model.engine_dir)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)  # a copy of the content only: never a link to the source
    engine = dict(
        model.engine,
        precision=model.precision,
        task=model.task,
        max_length=the_plan.model.max_length,
        tokenizer=TOKENIZER_DIR if (stage / TOKENIZER_DIR).exists() else None,
    )
    runner = load_engine(stage, engine, threads=threads)
    if hasattr(runner, "signature"):  # runtimes that take named arrays say what they take
        engine["inputs"] = runner.signature()
    return engine, runner


def _ship_extra_files(files: dict[str, Path], stage: Path) -> None:
    for relative, path in files.items():
        dest = stage / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)


def _threads(requested: int) -> dict:
    import os

    info = {"requested": requested or "all", "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch_intra_op"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def _manifest(cfg, recipe_name, ctx, source, engine, metrics, verdict, eval_data, started, stage: Path) -> dict:
    calib = ctx.calibration_used()
    resolved = recipe_dict(cfg)
    hashes = source_hash(source)
    return {
        "id": artifact.content_id(resolved, hashes, stage),  # before the reports: they hold the id
        "parent_id": artifact.parent_id(source.location, hashes),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": {"name": recipe_name, "resolved": resolved},
        "model": {
            "source": cfg.model.source,
            "resolved": source.location,
            "task": source.task,
            "sha256": hashes,
            **source.info,
        },
        "calibration": calib,
        "evaluation": eval_data,
        "engine": engine,
        "stages": ctx.stage_records,
        "metrics": metrics,
        "gate": verdict.to_dict(),
        "verdict": "passed" if verdict.passed else "failed",
        "environment": environment.describe(),
        "duration_s": round(time.time() - started, 1),
    }
