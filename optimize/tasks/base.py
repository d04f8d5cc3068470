"""The base task: any ONNX model, judged output by output."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optimize.errors import RecipeError

if TYPE_CHECKING:
    from optimize.context import Context, Encoder
    from optimize.workload import Workload


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
    # A task whose models generate tokens (a causal LM): its workload is request shapes (prompt and
    # output tokens) instead of batch sizes, the race builds decoders, and served latency applies.
    generates: bool = False
    hub_pipeline_tag: str | None = None  # the Hugging Face Hub's `pipeline_tag` for its model card

    def baseline_runner(self, module, ctx: Context):
        """The source module as the baseline runs it: PyTorch FP32 over the task's named inputs."""
        from engines.pytorch.runner import TorchRunner

        return TorchRunner(self.module(module, ctx), list(self.input_names), list(self.output_names), ctx.threads)

    def module(self, model, ctx: Context):
        """The PyTorch module to export and to run as the baseline (forward takes input_names in order)."""
        raise RecipeError(f"model.task={self.name} has no PyTorch wrapper; give an ONNX source")

    def load_source(self, cfg, path: Path | None):
        """A task whose models are not Hugging Face ones loads its own source (None: the default loaders)."""
        return None

    def files(self, ctx: Context) -> dict[str, Path]:
        """Files the artifact ships for this task ({relative path: file}), written once the stages ran."""
        return {}

    def check_source(self, ctx: Context) -> None:
        """Refuse a model that does not fit its data (a classifier whose labels the data lacks)."""

    def encoder(self, ctx: Context) -> Encoder | None:
        """The encoder of a task whose inputs are not text (images); None: the tokenizer's, or the
        ONNX graph's tensors."""
        return None

    def check_workload(self, ctx: Context, workload: Workload) -> None:
        """Refuse, before any build, a workload the model cannot take (a prompt past its context)."""

    def race_scores(self, reference: dict, outputs: dict, ctx: Context) -> dict:
        """Figures the race scores each candidate on beside fidelity (a classifier's labeled
        accuracy, which its gate reads); {}: fidelity alone."""
        return {}

    def training_samples(self, ctx: Context, texts: list[str], seq_len: int) -> dict:
        """Training samples of `texts` as int64 tensors of the model's inputs, `seq_len` tokens long."""
        import torch

        return {k: torch.as_tensor(v)[:, :seq_len] for k, v in ctx.encode(texts).items()}

    def evaluate(self, baseline, candidate, ctx: Context) -> tuple[dict, dict]:
        """Returns (metrics {baseline, candidate}, description of the evaluation data)."""
        from optimize.evaluate.harness import compare_runners

        return compare_runners(baseline, candidate, ctx, self.fidelity_output)
