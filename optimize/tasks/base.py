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
    # What the distill stage matches on the output: "logits" (next-token KL), "embedding" (pooled
    # cosine), "class_logits" (KL of the class distribution, per text or per token), or None (the
    # task is not distilled).
    distill_loss: str | None = None

    def module(self, model, ctx):
        """The PyTorch module to export and to run as the baseline (forward takes input_names in order)."""
        raise RecipeError(f"model.task={self.name} has no PyTorch wrapper; give an ONNX source")

    def load_source(self, cfg, path: Path | None):
        """A task whose models are not Hugging Face ones loads its own source (None: the default loaders)."""
        return None

    def files(self, ctx) -> dict[str, Path]:
        """Files the artifact ships for this task ({relative path: file}), written once the stages ran."""
        return {}

    def training_samples(self, ctx, texts: list[str], seq_len: int) -> dict:
        """Training samples of `texts` as int64 tensors of the model's inputs, `seq_len` tokens long."""
        import torch

        return {k: torch.as_tensor(v)[:, :seq_len] for k, v in ctx.encode(texts).items()}

    def evaluate(self, baseline, candidate, ctx) -> tuple[dict, dict]:
        """Returns (metrics {baseline, candidate}, description of the evaluation data)."""
        from optimize.evaluate.harness import compare_runners

        return compare_runners(baseline, candidate, ctx, self.fidelity_output)
