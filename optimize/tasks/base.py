"""The base task: any ONNX model, judged output by output."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from optimize.errors import RecipeError


@dataclass
class Task:
    """Base task: any ONNX model, judged output by output on data or random inputs."""

    name: str = "generic"
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    dynamic_axes: dict = field(default_factory=dict)
    fidelity_output: str | None = None  # the output whose fidelity decides accuracy; None: all outputs

    def module(self, model, ctx):
        """The PyTorch module to export and to run as the baseline (forward takes input_names in order)."""
        raise RecipeError(f"model.task={self.name} has no PyTorch wrapper; give an ONNX source")

    def load_source(self, cfg, path: Path | None):
        """A task whose models are not Hugging Face ones loads its own source (None: the default loaders)."""
        return None

    def evaluate(self, baseline, candidate, ctx) -> tuple[dict, dict]:
        """Returns (metrics {baseline, candidate}, description of the evaluation data)."""
        from optimize.evaluate.harness import compare_runners

        return compare_runners(baseline, candidate, ctx, self.fidelity_output)
