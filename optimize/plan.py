"""The plan: the recipe resolved once, before any weights load, into the typed values that stages,
methods and tasks read. Each field is named after its recipe key (`plan.evaluate.top_k` is
`evaluate.top_k`), so renaming a key in optimize/config.py shows here, and mypy shows who reads it.

Only the entry point (optimize/__main__.py) and this module read the raw recipe; the pipeline checks it
(optimize/pipeline.py) and builds the plan with `resolve`. The manifest still records the recipe as
composed (`recipe_dict(cfg)`): the plan is what the run reads, not what it reports.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimize.config import recipe_dict
from optimize.errors import RecipeError

if TYPE_CHECKING:
    from optimize.registry import Method
    from optimize.tasks.base import Task
    from optimize.workload import Workload


@dataclass(frozen=True)
class DataSettings:
    """A data section (`calibration`, `evaluate.data`) as optimize/config.py's DataConfig has it."""

    source: str
    split: str
    count: int
    seed: int
    path: str | None
    field: str
    label_field: str | None
    min_chars: int
    dataset_split: str | None
    shape: list[int] | None
    image: Mapping[str, Any]
    audio: Mapping[str, Any]

    @classmethod
    def of(cls, node) -> "DataSettings":
        # The optional keys are read with get: a manifest's recorded recipe may predate them.
        shape = node.get("shape")
        return cls(
            source=node.source,
            split=node.split,
            count=node.count,
            seed=node.seed,
            path=node.path,
            field=node.field,
            label_field=node.get("label_field"),
            min_chars=node.min_chars,
            dataset_split=node.get("dataset_split"),
            shape=list(shape) if shape is not None else None,
            image=recipe_dict(node.get("image")),
            audio=recipe_dict(node.get("audio")),
        )


@dataclass(frozen=True)
class EvaluateSettings:
    """`evaluate`: how the baseline and the candidate are compared and timed."""

    data: DataSettings
    inputs: str  # data | random
    batch_sizes: tuple[int, ...]
    warmup: int
    repeats: int
    retimes: int  # more runs of a point timed while the machine was busy (benchmark.quietest)
    top_k: int
    threads: int  # 0: all cores
    memory: bool
    latency: bool
    overlap: str  # error | drop
    task_params: Mapping[str, Any]

    @classmethod
    def of(cls, node) -> "EvaluateSettings":
        return cls(
            data=DataSettings.of(node.data),
            inputs=node.inputs,
            batch_sizes=tuple(int(b) for b in node.batch_sizes),
            warmup=node.warmup,
            repeats=node.repeats,
            retimes=_retimes(node.retimes),
            top_k=node.top_k,
            threads=node.threads,
            memory=node.memory,
            latency=node.latency,
            overlap=node.overlap,
            task_params=recipe_dict(node.get("task_params")),
        )


def _retimes(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecipeError(f"evaluate.retimes={value!r}: give a whole number of runs, 0 or more")
    return value


@dataclass(frozen=True)
class ModelSettings:
    """`model`: the source and how it is read."""

    source: str
    task: str
    revision: str | None
    gguf_file: str | None
    tokenizer: str | None
    hub_id: str | None
    max_length: int
    trust_remote_code: bool
    allow_pickle: bool
    inputs: Mapping[str, Any]  # {input name: InputSpec's keys} of a model that takes tensors

    @classmethod
    def of(cls, node) -> "ModelSettings":
        return cls(
            source=node.source,
            task=node.task,
            revision=node.revision,
            gguf_file=node.gguf_file,
            tokenizer=node.tokenizer,
            hub_id=node.hub_id,
            max_length=node.max_length,
            trust_remote_code=node.trust_remote_code,
            allow_pickle=node.allow_pickle,
            inputs=recipe_dict(node.inputs),
        )


@dataclass(frozen=True)
class MethodSettings:
    """A stage section (`prune`, ...) as the recipe set it: the method's name and its parameters."""

    method: str
    params: Mapping[str, Any]

    @classmethod
    def of(cls, node) -> "MethodSettings":
        return cls(method=node.method, params=recipe_dict(node.params))

    def record(self) -> dict[str, Any]:
        """The section as the recipe has it ({method, params}), for records and cache keys."""
        return {"method": self.method, "params": dict(self.params)}


@dataclass(frozen=True)
class ServeSettings:
    """`serve`: what the artifact must serve (the rest of the section is recorded for the server)."""

    structured_output: bool  # constrained output (JSON schemas, forced tool calls) on its engine

    @classmethod
    def of(cls, node) -> "ServeSettings":
        # Read with get: a manifest's recorded recipe may predate the key.
        return cls(structured_output=bool(node.get("structured_output", False)) if node is not None else False)


@dataclass(frozen=True)
class GateSettings(Mapping[str, Any]):
    """`gate`: the thresholds (null: not checked) and the selectors that say where a check is measured,
    typed and checked once when the plan is made. The schema and what each key means: GateConfig
    (optimize/config.py), which this mirrors key for key. As a read-only mapping it is also what
    gate.judge reads: its checks (optimize/gate.py CHECKS) name their thresholds by key."""

    min_cosine: float | None = None
    min_mean_cosine: float | None = None
    min_topk_agreement: float | None = None
    max_abs_error: float | None = None
    min_speedup: float | None = None
    speedup_batch_size: int | str = 1  # a batch size or `all` (optimize/workload.py checks which)
    max_p95_ms: float | None = None
    latency_batch_size: int | str = 1
    max_size_mb: float | None = None
    max_peak_memory_mb: float | None = None
    max_accuracy_drop: float | None = None
    min_accuracy: float | None = None
    max_f1_drop: float | None = None
    min_prediction_agreement: float | None = None
    min_mask_iou: float | None = None
    min_mask_agreement: float | None = None
    max_ppl_increase_pct: float | None = None
    max_ppl_increase_over_source_pct: float | None = None
    min_decode_speedup: float | None = None
    request_shape: str | None = None  # "1024x128", `all`, or null: the workload's first request
    max_lm_eval_drop: float | None = None
    max_served_ttft_p95_ms: float | None = None
    min_served_tokens_per_s: float | None = None
    served_concurrency: int | str | None = None  # clients, `all`, or null: every workload level
    served_prompt_tokens: int | None = None
    served_output_tokens: int | None = None
    served_requests_per_client: int = 2
    served_structured_share: float = 0.0
    max_served_invalid_structured: int | None = None
    max_mean_kld: float | None = None
    max_p99_kld: float | None = None
    min_top1_agreement: float | None = None
    max_rms_delta_p_pct: float | None = None
    max_task_drop_pts: float | None = None
    min_distill_recovery: float | None = None

    @classmethod
    def of(cls, section: GateSettings | Mapping[str, Any] | None) -> GateSettings:
        """The gate of a recipe's `gate` section (a key it leaves out keeps its default); RecipeError
        naming the key for a key the gate does not have or a value not of its type."""
        if isinstance(section, GateSettings):
            return section
        given = section if isinstance(section, dict) else recipe_dict(section)
        unknown = sorted(set(given) - set(_GATE_TYPES))
        if unknown:
            raise RecipeError(f"gate.{unknown[0]}: no such key in the gate (GateConfig, optimize/config.py)")
        return cls(**{key: _gate_value(key, value) for key, value in given.items()})

    # The read-only mapping: every key, in the schema's order.
    def __getitem__(self, key: str) -> Any:
        if key not in _GATE_TYPES:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_GATE_TYPES)

    def __len__(self) -> int:
        return len(_GATE_TYPES)


# Each gate key and the types its value may have (None where null is allowed), from the annotations.
_GATE_TYPES: dict[str, tuple[type, ...]] = {
    key: typing.get_args(hint) or (hint,) for key, hint in typing.get_type_hints(GateSettings).items()
}


def _gate_value(key: str, value: Any) -> Any:
    """The value, checked against the key's types (a whole number is a float where a float is asked)."""
    types = _GATE_TYPES[key]
    if value is None and type(None) in types:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if int in types:
            return value
        if float in types:
            return float(value)
    elif isinstance(value, float) and float in types:
        return value
    elif isinstance(value, str) and str in types:
        return value
    raise RecipeError(f"gate.{key}={value!r}: give {' or '.join(_KIND_NAMES[t] for t in types)}")


_KIND_NAMES = {float: "a number", int: "a whole number", str: "a word (all)", type(None): "null"}


@dataclass(frozen=True)
class Plan:
    """The recipe checked and resolved before any weights load."""

    task: Task  # model.task, looked up
    stages: tuple[tuple[Method, Any], ...]  # the stages that run, each with its method's config
    workload: Workload  # the traffic the race optimizes and the gate checks, resolved once
    model: ModelSettings
    calibration: DataSettings
    evaluate: EvaluateSettings
    gate: GateSettings  # the thresholds and selectors, typed (a read-only mapping for gate.judge)
    prune: MethodSettings  # recorded by the distill stage, which learns back what pruning took
    serve: ServeSettings
    final_dir: Path  # where the artifact goes

    @property
    def needs_calibration(self) -> bool:
        return any(method.needs_calibration for method, _ in self.stages)


def resolve(cfg, task: Task, stages, the_workload: Workload, the_gate: GateSettings, final_dir: Path) -> Plan:
    """The plan of a composed recipe whose task, stages, workload and gate the pipeline already resolved."""
    check_finite(_recipe_only(cfg))
    check_serve(cfg.get("serve"))
    check_packages(stages)
    return Plan(
        task=task,
        stages=tuple(stages),
        workload=the_workload,
        model=ModelSettings.of(cfg.model),
        calibration=DataSettings.of(cfg.calibration),
        evaluate=EvaluateSettings.of(cfg.evaluate),
        gate=the_gate,
        prune=MethodSettings.of(cfg.prune),
        serve=ServeSettings.of(cfg.get("serve")),
        final_dir=final_dir,
    )


def check_finite(recipe: Mapping[str, Any]) -> None:
    """Every number of the recipe finite: NaN passes every `<= 0` check (a NaN learning rate trains to
    NaN, a NaN budget never runs out) and neither NaN nor inf is JSON, which the manifest must be."""
    for key, value in _leaves(recipe, ""):
        if isinstance(value, float) and not math.isfinite(value):
            raise RecipeError(f"{key}={value}: give a finite number")


def _recipe_only(cfg) -> dict[str, Any]:
    """The recipe resolved without Hydra's own settings (composed before a run, they do not resolve)."""
    from omegaconf import OmegaConf

    return recipe_dict(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))


def _leaves(node: Any, prefix: str):
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{prefix.rstrip('.')}[{i}].")
    else:
        yield prefix.rstrip("."), node


def check_serve(node) -> None:
    """The recipe's `serve` settings checked as `python -m serve` checks its flags (one validator,
    serve/config.py): an artifact recording max_batch_size=0 would answer every request 500."""
    if node is None:
        return
    from serve.config import RECIPE_KEYS, setting_problem

    for key in RECIPE_KEYS:
        problem = setting_problem(key, node.get(key))
        if problem:
            raise RecipeError(f"serve.{key}: {problem} (as python -m serve --{key.replace('_', '-')} checks it)")


def check_packages(stages) -> None:
    """Each stage's method has the optional packages it requires (its registration says which):
    found now, not after minutes of loading the model."""
    for method, _ in stages:
        missing = method.missing_package()
        if missing:
            raise RecipeError(missing)
