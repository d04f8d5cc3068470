"""Image classification: the digits CNN, its source loader, and top-1 accuracy on held-out labels.

    model:
      source: pkg://optimize/assets/digits_cnn   # config.json + model.safetensors (no pickle)
      task: image_classification

Inputs are `pixel_values` [N, 1, H, W] float32 with raw pixel values (the module scales them), so
the ONNX engine and the PyTorch baseline take the same arrays the data source gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from optimize.context import Context, Encoder, SourceModel
from optimize.errors import RecipeError
from optimize.tasks import register_task
from optimize.tasks.base import Task

ARCHITECTURE = "digits_cnn"


def build_cnn(config: dict):
    """conv(3x3) -> ReLU -> conv(3x3) -> ReLU -> maxpool(2) -> linear -> ReLU -> linear (logits)."""
    import torch
    from torch import nn

    c1, c2 = config["channels"]
    side = config["image_size"] // 2

    class DigitsCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
            )
            self.classifier = nn.Sequential(
                nn.Flatten(),
                nn.Linear(c2 * side * side, config["hidden"]),
                nn.ReLU(),
                nn.Linear(config["hidden"], config["num_classes"]),
            )

        def forward(self, pixel_values):
            # Scaling inside the graph: callers feed raw pixels, as the data source and serve/ give them.
            return self.classifier(self.features(pixel_values / config["pixel_max"]))

    torch.manual_seed(config.get("seed", 0))
    return DigitsCNN()


def load_cnn(folder: Path):
    """The CNN from folder/config.json and folder/model.safetensors."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    if config.get("architecture") != ARCHITECTURE:
        raise RecipeError(
            f"model.source={folder}: config.json architecture is {config.get('architecture')!r}, "
            f"this loader knows {ARCHITECTURE!r}"
        )
    module = build_cnn(config)
    module.load_state_dict(load_file(str(folder / "model.safetensors")))
    return module.eval(), config


def load_source(cfg, path: Path | None):
    if path is None or not path.is_dir():
        raise RecipeError(
            f"model.source={cfg.source}: image_classification needs a local folder "
            "(config.json + model.safetensors); train one with python -m optimize.train.digits DIR"
        )
    module, config = load_cnn(path)
    # kind "torch": a PyTorch module without a tokenizer (the pipeline exports it like any module).
    return SourceModel(
        "torch",
        cfg.task,
        str(path),
        module=module,
        info={
            "class": ARCHITECTURE,
            "parameters": sum(p.numel() for p in module.parameters()),
            "trained": config.get("trained", {}),
        },
    )


def encode_images(items: list) -> dict[str, np.ndarray]:
    """Images [H, W] (or [C, H, W]) -> pixel_values [N, C, H, W] float32."""
    if any(isinstance(i, str) for i in items):
        raise RecipeError(
            "image_classification takes images, and this data source gives text (use an image source such as digits)"
        )
    batch = np.stack([np.asarray(i, dtype=np.float32) for i in items])
    return {"pixel_values": batch[:, None] if batch.ndim == 3 else batch}


def top1_accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(axis=1) == labels).mean())


@dataclass
class ImageClassification(Task):
    name: str = "image_classification"
    hub_pipeline_tag: str | None = "image-classification"
    input_names: tuple[str, ...] = ("pixel_values",)
    output_names: tuple[str, ...] = ("logits",)
    dynamic_axes: dict = field(default_factory=lambda: {"pixel_values": {0: "batch"}})
    fidelity_output: str | None = "logits"

    def module(self, model, ctx: Context):
        return model

    def load_source(self, cfg, path: Path | None) -> SourceModel:
        return load_source(cfg, path)

    def encoder(self, ctx: Context) -> Encoder | None:
        return encode_images

    def evaluate(self, baseline, candidate, ctx: Context) -> tuple[dict, dict]:
        """Top-1 accuracy of both on the held-out labelled split, the drop in points, logit fidelity,
        and the shared size/latency/memory figures."""
        from optimize.evaluate import fidelity, harness

        data = self._labeled_data(ctx)
        inputs = ctx.encode(data.items)
        metrics = harness.shared_metrics(baseline, candidate, inputs, ctx.plan.evaluate, ctx.scratch)
        batches = harness.batches_of(inputs, harness.FIDELITY_BATCH)
        base = harness.run_all(baseline.runner, batches)["logits"]
        cand = harness.run_all(candidate.runner, batches)["logits"]
        scores = self.race_scores({"logits": base}, {"logits": cand}, ctx)
        metrics["baseline"]["top1_accuracy"] = top1_accuracy(base, np.asarray(data.labels))
        metrics["candidate"].update(scores)
        metrics["candidate"]["fidelity"] = dict(
            fidelity.output_fidelity({"logits": base}, {"logits": cand}),
            prediction_agreement=float((base.argmax(1) == cand.argmax(1)).mean()),
        )
        return metrics, data.describe()

    def race_scores(self, reference: dict, outputs: dict, ctx: Context) -> dict:
        """The candidate's top-1 accuracy and its drop in points: what the gate reads, so the race
        judges each candidate on the same figures."""
        labels = np.asarray(self._labeled_data(ctx).labels)
        base, cand = top1_accuracy(reference["logits"], labels), top1_accuracy(outputs["logits"], labels)
        return {"top1_accuracy": cand, "accuracy_drop_points": 100 * (base - cand)}

    def _labeled_data(self, ctx: Context):
        if ctx.plan.evaluate.inputs != "data":
            raise RecipeError("image_classification is judged on labelled data: set evaluate.inputs=data")
        data = ctx.evaluation_data()
        if data.labels is None:
            raise RecipeError(
                f"evaluate.data.source={data.source} has no labels; image_classification needs "
                "a labelled source (for example digits)"
            )
        return data


register_task(ImageClassification())
