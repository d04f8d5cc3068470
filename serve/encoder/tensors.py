"""A model that takes tensors (an image model, an audio model, any ONNX file) behind the batcher.

Requests carry exactly the inputs the manifest's engine declares, in their declared datatypes, with
every fixed dimension as declared; anything else is a 422 naming the input, before the model runs.
Requests whose inputs all carry the batch on axis 0 and share the other dimensions are run together;
others (a recurrent state with the batch on axis 1, a shared scalar such as a sample rate) run alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from serve.encoder.datatypes import NUMPY_TO_KSERVE, ORT_TO_NUMPY
from serve.errors import unprocessable

if TYPE_CHECKING:
    from serve.config import ServeConfig


@dataclass
class TensorBatchItem:
    inputs: dict[str, np.ndarray]
    rows: int
    together: bool  # may be concatenated with other requests along axis 0 (and split into pieces)

    def key(self) -> tuple:
        return tuple((name, array.shape[1:]) for name, array in self.inputs.items())

    def split(self, size: int) -> list[TensorBatchItem]:
        """Pieces of at most `size` rows along axis 0; a request that cannot be cut there runs whole."""
        if not self.together or self.rows <= size:
            return [self]
        return [
            TensorBatchItem(
                {name: array[i : i + size] for name, array in self.inputs.items()}, min(size, self.rows - i), True
            )
            for i in range(0, self.rows, size)
        ]


class TensorModel:
    ANSWERS: ClassVar[frozenset[str]] = frozenset({"tensors"})
    USE: ClassVar[str] = "a {task} model: use /v2/models/{name}/infer"

    @classmethod
    def load(cls, root: Path, engine: dict, config: ServeConfig) -> TensorModel:
        return cls(root, engine, config.ort_threads(), spinning=config.ort_spinning)

    def __init__(self, root: Path, engine: dict, threads: int = 0, spinning: bool = False):
        from engines import load_engine
        from engines.runners import DescribedRunner

        self.task = engine.get("task", "generic")
        runner = load_engine(root, engine, threads=threads, spinning=spinning)
        if not isinstance(runner, DescribedRunner):
            raise ValueError(
                f"engine format {engine.get('format')!r} does not describe its tensors: it cannot serve here"
            )
        self.runner: DescribedRunner = runner
        self.input_names = list(self.runner.input_names)
        self.output_names = list(self.runner.output_names)
        self.inputs_meta = {i["name"]: i for i in self.runner.signature()}
        self.outputs_meta = {o["name"]: o for o in self.runner.output_signature()}
        first_dims = [meta["shape"][0] if meta["shape"] else None for meta in self.inputs_meta.values()]
        # Requests batch together when every input's first dim is one and the same symbolic dim.
        self.batchable = bool(first_dims) and all(isinstance(d, str) and d == first_dims[0] for d in first_dims)

    def tensor_metadata(self) -> tuple[list[dict], list[dict]]:
        def describe(arg: dict) -> dict:
            dtype = np.dtype(ORT_TO_NUMPY.get(arg["type"], "float32"))
            shape = [d if isinstance(d, int) else -1 for d in arg["shape"]]
            return {"name": arg["name"], "datatype": NUMPY_TO_KSERVE.get(dtype, "FP32"), "shape": shape}

        return [describe(i) for i in self.inputs_meta.values()], [describe(o) for o in self.outputs_meta.values()]

    def from_tensors(self, inputs: dict[str, np.ndarray]) -> TensorBatchItem:
        names = set(inputs)
        if names != set(self.input_names):
            unknown, missing = sorted(names - set(self.input_names)), sorted(set(self.input_names) - names)
            raise unprocessable(f"inputs must be {self.input_names}; unknown {unknown}, missing {missing}")
        for name in self.input_names:
            self.check(name, inputs[name])
        ordered = {name: inputs[name] for name in self.input_names}
        rows = [a.shape[0] for a in ordered.values() if a.ndim]
        if self.batchable and len(set(rows)) != 1:
            raise unprocessable(f"inputs must share their batch size (dim 0); got {dict(zip(self.input_names, rows))}")
        if self.batchable and rows[0] < 1:
            raise unprocessable("batch size must be at least 1")
        return TensorBatchItem(ordered, rows[0] if self.batchable else 1, self.batchable)

    def check(self, name: str, array: np.ndarray) -> None:
        meta = self.inputs_meta[name]
        want = np.dtype(ORT_TO_NUMPY.get(meta["type"], "float32"))
        if array.dtype != want:
            raise unprocessable(
                f"input {name!r} must be {NUMPY_TO_KSERVE.get(want, want.name)}, got "
                f"{NUMPY_TO_KSERVE.get(array.dtype, array.dtype.name)}"
            )
        declared = [d if isinstance(d, int) else -1 for d in meta["shape"]]
        fits = array.ndim == len(declared) and all(d in (-1, s) for d, s in zip(declared, array.shape))
        if not fits:
            raise unprocessable(f"input {name!r} has shape {list(array.shape)}; the model takes {declared} (-1: any)")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise unprocessable(f"input {name!r} holds NaN or infinity")

    def run_batch(self, items: list[TensorBatchItem]) -> list[dict[str, np.ndarray]]:
        """Requests of the same shape run as one call; the rest one by one."""
        results: dict[int, dict[str, np.ndarray]] = {}  # by the item's index
        groups: dict[tuple, list[int]] = {}
        for index, item in enumerate(items):
            groups.setdefault(item.key() if item.together else ("alone", index), []).append(index)
        for members in groups.values():
            if len(members) == 1:
                results[members[0]] = self.run(items[members[0]].inputs)
                continue
            feed = {n: np.concatenate([items[i].inputs[n] for i in members]) for n in self.input_names}
            outputs, start = self.run(feed), 0
            for i in members:
                rows = slice(start, start + items[i].rows)
                results[i] = {name: value[rows] for name, value in outputs.items()}
                start += items[i].rows
        return [results[index] for index in range(len(items))]

    def run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call; the model failing on inputs of declared types and ranks is the request's fault
        (an image side that is not a multiple of the network's stride): 422 with the runtime's reason."""
        try:
            return self.runner(feed)
        except Exception as exc:  # ONNX Runtime raises its own types (Fail, InvalidArgument, RuntimeException)
            shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in feed.items())
            reason = " ".join(str(exc).split()).split("Status Message:")[-1].strip()[:300]
            raise unprocessable(f"the model cannot run on {shapes}: {reason}") from None
