"""A tensor model's inputs from data: items stacked along the batch (and every other input made from
its plan), random batches from the specs, and one probe run of the source model on the first batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from optimize.errors import RecipeError
from optimize.inputs.plan import BATCH, InputPlan, plan_inputs, random_tensor

TENSOR_SOURCES = "image_folder, npy, audio_folder"


class Batch(dict):
    """Named inputs whose batch is not on axis 0 of every array: `batch_axes` maps an input to the
    axis its samples are on (a recurrent state [layers, N, hidden] has them on 1), or to None for an
    input every sample shares (a sample rate). Inputs it does not name are batched on axis 0."""

    def __init__(self, arrays: dict, batch_axes: dict[str, int | None]):
        super().__init__(arrays)
        self.batch_axes = batch_axes


class TensorEncoder:
    """Items (arrays, one per sample) -> the model's named inputs; random batches from the specs.
    The first batch it makes is run through the source model once, so a model that cannot run on the
    recipe's shapes fails here with the shapes and the runtime's message (exit 2), not deep inside a stage."""

    def __init__(self, plans: list[InputPlan], probe=None):
        self.plans = plans
        self.data_input = next((p for p in plans if p.value is None), None)
        self._probe = probe

    @classmethod
    def for_onnx(cls, path: Path, given: dict, threads: int = 0) -> "TensorEncoder":
        import onnx

        from engines.onnxruntime.runner import OrtRunner

        runner = OrtRunner(path, threads=threads, quiet=True)
        metadata = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        return cls(plan_inputs(runner.signature(), given, metadata), probe=runner)

    def describe(self) -> str:
        return ", ".join(p.describe() for p in self.plans)

    def record(self) -> dict:
        """For the manifest: which input the data feeds and every input as resolved."""
        return {
            "data_input": self.data_input.name if self.data_input else None,
            "resolved": {
                p.name: {
                    "dims": [BATCH if d == BATCH else d for d in p.dims],
                    "dtype": np.dtype(p.dtype).name,
                    "value": p.value,
                }
                for p in self.plans
            },
        }

    def __call__(self, items: list) -> dict[str, np.ndarray]:
        if any(isinstance(i, str) for i in items):
            raise RecipeError(
                f"the data source gives text, and this model takes tensors ({self.describe()}): use a tensor "
                f"source ({TENSOR_SOURCES}), model.tokenizer=DIR for token ids, or evaluate.inputs=random"
            )
        if self.data_input is None:
            raise RecipeError("every model input has a constant value in model.inputs: nothing for the data to feed")
        data = np.stack([np.asarray(i) for i in items]).astype(self.data_input.dtype, copy=False)
        self._check_data(data)
        rng = np.random.default_rng(0)
        batch = {p.name: data if p is self.data_input else random_tensor(p, len(items), rng) for p in self.plans}
        return self._checked(batch)

    def random(self, count: int, seed: int) -> dict[str, np.ndarray]:
        """`count` samples of random data shaped from the specs (evaluate.inputs=random, calibration=random)."""
        rng = np.random.default_rng(seed)
        return self._checked({p.name: random_tensor(p, count, rng) for p in self.plans})

    def _check_data(self, data: np.ndarray) -> None:
        plan = self.data_input
        assert plan is not None
        if data.ndim != len(plan.dims):
            raise RecipeError(
                f"the data source gives items of shape {list(data.shape[1:])}, and model input "
                f"{plan.describe()} takes {len(plan.dims) - 1} dims per sample"
            )
        # Only the graph's own fixed dims bind data: the recipe's values for symbolic ones shape
        # random data, while images or audio bring their own size.
        for i, (have, want) in enumerate(zip(data.shape, plan.spec.get("_model_dims", plan.dims))):
            if i and isinstance(want, int) and have != want:
                raise RecipeError(
                    f"the data source gives items of shape {list(data.shape[1:])}, and model input "
                    f"{plan.describe()} needs {want} at dim {i}"
                )

    def _checked(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # The data input first: what counts samples reads the first input batched on axis 0.
        order = sorted(self.plans, key=lambda p: p is not self.data_input)
        axes = {p.name: (p.dims.index(BATCH) if BATCH in p.dims else None) for p in order}
        batch = Batch({p.name: arrays[p.name] for p in order}, axes)
        if self._probe is not None:
            probe, self._probe = self._probe, None
            run_or_refuse(probe, {p.name: _first_sample(batch[p.name], p.dims) for p in self.plans})
        return batch


def _first_sample(array: np.ndarray, dims: list) -> np.ndarray:
    """The array cut to batch 1 along every batch dim (a state may carry the batch on dim 1)."""
    index = tuple(slice(0, 1) if d == BATCH else slice(None) for d in dims)
    return array[index] if len(index) == array.ndim else array


def run_or_refuse(runner, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the model once; a failure is the model's on these inputs: one line naming the shapes."""
    try:
        return runner(inputs)
    except Exception as exc:  # ONNX Runtime raises its own types (Fail, RuntimeException, InvalidArgument...)
        shapes = ", ".join(f"{k}{list(v.shape)} {v.dtype}" for k, v in inputs.items())
        message = " ".join(str(exc).split())
        message = message.split("Status Message:")[-1].strip() if "Status Message:" in message else message
        raise RecipeError(
            f"the model fails on the inputs {shapes}: {message[:300]} "
            f"(change ++model.inputs.NAME.shape or the data's size)"
        ) from None
