"""PyTorch -> ONNX export with torch.onnx's dynamo exporter, checked against the source model.

The TorchScript exporter was measured to drift from PyTorch on BERT-style encoders (cosine
0.94-0.97), so only the dynamo path is used, and every export is compared with the source
module on real inputs before anything else touches it (as Optimum does with its atol check).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


class ExportMismatch(Exception):
    """The exported graph does not compute what the PyTorch module computes."""


def export(
    module,
    example: dict[str, np.ndarray],
    output_names: list[str],
    path: Path,
    dynamic_axes: dict[str, dict[int, str]],
    opset: int = 18,
) -> Path:
    """Export `module` (forward takes the example's keys positionally, in order) to `path`."""
    import torch

    dims: dict[str, object] = {}
    dynamic_shapes: dict[str, dict[int, object]] = {}
    for name, axes in dynamic_axes.items():
        dynamic_shapes[name] = {axis: dims.setdefault(label, torch.export.Dim(label)) for axis, label in axes.items()}
    # Keyword inputs in the forward's order: the exporter names graph inputs after them.
    kwargs = {name: torch.from_numpy(array) for name, array in example.items()}
    program = torch.onnx.export(
        module.eval(),
        (),
        kwargs=kwargs,
        dynamo=True,
        dynamic_shapes=dynamic_shapes,
        output_names=output_names,
        opset_version=opset,
        verbose=False,
    )
    if program is None:  # the dynamo exporter returns the program it wrote
        raise RuntimeError(f"torch.onnx.export returned no program for {path}")
    program.save(str(path), external_data=False)
    return path


def compare_outputs(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per output: max abs error and the minimum per-sample cosine (samples along axis 0)."""
    report = {}
    for name, ref in reference.items():
        got = candidate[name].astype(np.float64).reshape(len(ref), -1)
        want = ref.astype(np.float64).reshape(len(ref), -1)
        norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
        cosine = (got * want).sum(1) / np.maximum(norms, 1e-30)
        report[name] = {"max_abs_error": float(np.abs(got - want).max()), "min_cosine": float(cosine.min())}
    return report


def check_fidelity(
    reference: dict[str, np.ndarray], exported: dict[str, np.ndarray], atol: float, min_cosine: float = 0.9999
) -> dict[str, dict]:
    report = compare_outputs(reference, exported)
    for name, r in report.items():
        if r["max_abs_error"] > atol or r["min_cosine"] < min_cosine:
            raise ExportMismatch(
                f"exported output {name!r} differs from PyTorch: max abs error "
                f"{r['max_abs_error']:.2e} (atol {atol:g}), min cosine {r['min_cosine']:.6f}"
            )
    return report


def copy_onnx(path: Path, folder: Path) -> Path:
    """Copy an ONNX graph as folder/model.onnx, with its external-data file if it has one (weights
    beside the graph, as the dynamo exporter writes them and as models over 2 GB need)."""
    import onnx

    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / "model.onnx"
    locations = {
        entry.value
        for tensor in onnx.load(str(path), load_external_data=False).graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    shutil.copy2(path, dest)
    for location in locations:
        source = path.parent / location
        if source.resolve().parent != path.parent.resolve() or not source.is_file():
            raise ValueError(f"{path}: external data {location!r} is not a file beside the graph")
        shutil.copy2(source, folder / location)
    return dest
