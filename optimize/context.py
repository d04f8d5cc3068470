"""What flows through a run: the model between stages (Model), the source as loaded (SourceModel),
and what stages and tasks may use (Context: the plan, scratch space, data, tokenizer)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

import calibration
from calibration import TextSet
from engines import formats
from optimize.errors import RecipeError

if TYPE_CHECKING:
    from optimize.evaluate.harness import Subject
    from optimize.plan import DataSettings, EvaluateSettings, Plan

log = logging.getLogger("optimize.pipeline")


@dataclass
class SourceModel:
    kind: str  # "hf" (a Hugging Face module), "torch" (another PyTorch module) or "onnx" (a file)
    task: str
    location: str  # resolved path or hub id
    module: Any = None  # the torch model for kinds "hf" and "torch"
    onnx_path: Path | None = None
    tokenizer_dir: Path | None = None
    gguf_file: str | None = None
    info: dict = field(default_factory=dict)


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
    # What later stages and the report need from earlier ones, typed rather than left on a blackboard:
    kept_layers: list[int] | None = None  # the source layers a prune stage kept (distill maps them)
    layer_precision: dict = field(default_factory=dict)  # {precision: {count, nodes}} of the weights
    # What the stage that returned this model did (the manifest's `stages` block): a method returns
    # its record with its result, and the pipeline files it under the stage's name.
    record: dict = field(default_factory=dict)
    # The records of the stages a method ran within its own, in the order they ran (the quantize
    # method that set a TensorRT plan's precision, the race winner's quantize), filed before it.
    inner_records: dict[str, dict] = field(default_factory=dict)
    # Files the stages ask the artifact to ship ({relative path: file}), kept across stages.
    files: dict[str, Path] = field(default_factory=dict)
    # Additions a stage makes to the evaluation's metrics before the gate judges them.
    metric_hooks: tuple[Callable[[dict], None], ...] = ()

    @property
    def onnx_path(self) -> Path | None:
        return self.engine_dir / self.engine["file"] if self.kind == "onnx" else None

    def onnx_file(self) -> Path:
        """The ONNX file of a model of kind "onnx" (as the export and the ONNX-side methods return)."""
        if self.onnx_path is None:
            raise ValueError(f"a model of kind {self.kind} has no ONNX file")
        return self.onnx_path

    def with_onnx(self, path: Path, precision: str | None = None) -> "Model":
        """The model as one ONNX file (alone in its directory) for ONNX Runtime."""
        path = Path(path)
        return dataclasses.replace(
            self,
            kind="onnx",
            module=None,
            engine_dir=path.parent,
            engine={"format": formats.ONNXRUNTIME, "file": path.name, "providers": ["CPUExecutionProvider"]},
            precision=precision or self.precision,
        )

    def recorded(
        self,
        info: dict,
        files: dict[str, Path] | None = None,
        metric_hook: Callable[[dict], None] | None = None,
        inner_records: dict[str, dict] | None = None,
    ) -> "Model":
        """This model with what its stage did: the record, files to ship, a metric hook, the records
        of the stages it ran within."""
        hooks = (*self.metric_hooks, metric_hook) if metric_hook else self.metric_hooks
        return dataclasses.replace(
            self,
            record=info,
            inner_records=inner_records or {},
            files={**self.files, **(files or {})},
            metric_hooks=hooks,
        )

    def file_into(self, records: dict, stage: str) -> "Model":
        """File what this model's stage did into `records` ({stage: record}, the manifest's `stages`):
        the records of the stages it ran within, then its own under `stage`. Returns the model
        without them, as the next stage takes it."""
        records.update(self.inner_records)
        if self.record:
            records[stage] = self.record
        return dataclasses.replace(self, record={}, inner_records={})

    def with_engine(self, engine_dir: Path, engine: dict, precision: str) -> "Model":
        return dataclasses.replace(
            self, kind="engine", module=None, engine_dir=Path(engine_dir), engine=engine, precision=precision
        )


class Encoder(Protocol):
    """Items to the model's named inputs: engines/text.py's TextEncoder (texts), optimize/inputs/encoder.py's
    TensorEncoder (arrays), a task's own (token_classification's WordEncoder on word lists,
    image_classification's encode_images on pictures)."""

    def __call__(self, items: list, /) -> dict[str, np.ndarray]: ...


@dataclass
class Context:
    """What stages and tasks may use: the plan (the recipe resolved), a scratch directory, the data,
    the tokenizer, the source model and its baseline."""

    plan: Plan
    scratch: Path
    source: SourceModel | None = None
    encoder: Encoder | None = None
    threads: int = 0
    stage_records: dict = field(default_factory=dict)  # {stage: what it did}, for the manifest
    # The source as it came on its own runtime (optimize/evaluate/subjects.py), built once before the
    # stages: the race scores candidates against it and the gate judges against the same one.
    baseline: Subject | None = None
    _calibration: TextSet | None = None
    _evaluation: TextSet | None = None

    def calibration(self) -> TextSet:
        if self._calibration is None:
            self._calibration = load_data(self.plan.calibration)
        return self._calibration

    def calibration_used(self) -> dict | None:
        """What calibration data the stages read (the manifest's `calibration`); None: none read it."""
        return self._calibration.describe() if self._calibration is not None else None

    def evaluation_data(self) -> TextSet:
        """Evaluation items, never overlapping the calibration items (checked by content hash)."""
        if self._evaluation is None:
            self._evaluation = evaluation_set(self.plan.evaluate, self._calibration)
        return self._evaluation

    def loaded_source(self) -> SourceModel:
        """The source model: stages and tasks run once the pipeline loaded it."""
        if self.source is None:
            raise RuntimeError("the source model is read before the pipeline loaded it")
        return self.source

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise RecipeError("this model has no tokenizer: set model.tokenizer=DIR or evaluate.inputs=random")
        return self.encoder(texts)

    def calibration_inputs(self, count: int) -> dict[str, np.ndarray]:
        """`count` calibration samples as the model's named inputs. A model that takes tensors and a
        recipe that names the random source get random tensors shaped by `model.inputs`."""
        from optimize.inputs.encoder import TensorEncoder

        data = self.calibration()
        if data.source == "random" and isinstance(self.encoder, TensorEncoder):
            return self.encoder.random(min(count, len(data.items)), data.seed)
        self.refuse_text_for_tensors(data, "calibration.source")
        return self.encode(data.items[:count])

    def refuse_text_for_tensors(self, data: TextSet, key: str) -> None:
        """A model that takes tensors fed from a text source: one line naming the source and the inputs."""
        from optimize.inputs.encoder import TENSOR_SOURCES, TensorEncoder

        if isinstance(self.encoder, TensorEncoder) and data.items and isinstance(data.items[0], str):
            raise RecipeError(
                f"{key}={data.source} gives text, and this model takes tensors ({self.encoder.describe()}): "
                f"set {key} to a tensor source ({TENSOR_SOURCES}) or random, or model.tokenizer=DIR for token ids"
                + (" or evaluate.inputs=random" if key.startswith("evaluate") else "")
            )

    @property
    def pooling(self) -> dict:
        """How the source's sentence embedding is pooled (sentence-transformers folders say so)."""
        from engines.pytorch.runner import read_pooling

        folder = self.source.tokenizer_dir if self.source else None
        return read_pooling(Path(folder)) if folder else {"mode": "mean", "normalize": False}

    def progress(self, items, label: str):
        for i, item in enumerate(items, 1):
            if i == 1 or i % 10 == 0 or i == len(items):
                log.info("%s %d/%d", label, i, len(items))
            yield item


def evaluation_set(settings: EvaluateSettings, calibration_set: TextSet | None) -> TextSet:
    """The evaluation items, less any the calibration set holds (evaluate.overlap: error | drop)."""
    data = load_data(settings.data)
    if calibration_set is None:
        return data
    try:
        return calibration.remove_overlap(calibration_set, data, settings.overlap)
    except calibration.DataError as exc:
        raise RecipeError(str(exc)) from None


def load_data(settings: DataSettings) -> TextSet:
    try:
        return calibration.load(
            settings.source,
            settings.split,
            settings.count,
            settings.seed,
            path=settings.path,
            field=settings.field,
            label_field=settings.label_field,
            min_chars=settings.min_chars,
            dataset_split=settings.dataset_split,
            shape=settings.shape,
            image=dict(settings.image),
            audio=dict(settings.audio),
        )
    except calibration.DataError as exc:
        raise RecipeError(f"{exc}") from None
