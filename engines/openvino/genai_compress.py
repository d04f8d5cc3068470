"""NNCF weight-only compression (INT4/INT8) of an OpenVINO GenAI causal-LM IR (the stateful IR that
engines/openvino/genai_build.py writes), and a summary of which weights ended at which precision."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from engines.openvino.genai_build import IR_FILE

WEIGHT_FORMATS = ("int4_sym", "int4_asym", "int8_asym")
# NNCF's measures for ranking which weights stay at 8 bits when ratio < 1: the first needs no data.
SENSITIVITY_METRICS = (
    "weight_quantization_error",
    "hessian_input_activation",
    "mean_activation_variance",
    "max_activation_variance",
    "mean_activation_magnitude",
)


def calibration_inputs(token_rows: Iterable[Iterable[int]]) -> list[dict[str, np.ndarray]]:
    """Model inputs for data-aware compression (AWQ, scale estimation, GPTQ): each row of token ids as
    one whole sequence from an empty cache (the state is zeros for each item, as NNCF infers them)."""
    items: list[dict[str, np.ndarray]] = []
    for row in token_rows:
        ids = np.asarray(list(row), dtype=np.int64)[None, :]
        if ids.shape[1] < 2:
            continue
        items.append(
            {
                "input_ids": ids,
                "attention_mask": np.ones_like(ids),
                "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None, :],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
        )
    return items


class CompressionError(RuntimeError):
    """NNCF refused the settings (for example a group size that does not divide the channels)."""


def compress_weights(
    xml: str | Path,
    out_dir: str | Path,
    mode: str = "int4_asym",
    group_size: int = 64,
    ratio: float = 1.0,
    awq: bool = False,
    scale_estimation: bool = False,
    gptq: bool = False,
    lora_correction: bool = False,
    lora_adapter_rank: int = 8,
    sensitivity_metric: Optional[str] = None,
    calibration_batches: Optional[list[dict[str, np.ndarray]]] = None,
    ignored_scope: Optional[dict] = None,
) -> Path:
    """NNCF weight-only compression of the IR at `xml`, written to out_dir/openvino_model.xml.

    int4 modes quantize `ratio` of the weight MatMuls (NNCF ranks them) to 4 bits in groups of
    `group_size` input channels and the rest (always the embedding and LM head, NNCF's backup
    precision) to INT8 per channel; int8_asym quantizes every weight to INT8 per channel. awq,
    scale_estimation, gptq and lora_correction (low-rank INT8 adapters of rank `lora_adapter_rank`
    fitted to what 4 bits lost, not with gptq) are data-aware and need `calibration_batches` (see
    calibration_inputs), as does a `sensitivity_metric` other than weight_quantization_error.
    The other files in xml's folder (tokenizer, configs) are copied when out_dir differs."""
    from engines.openvino.build import no_telemetry

    no_telemetry()
    import nncf
    import openvino as ov

    if mode not in WEIGHT_FORMATS:
        raise ValueError(f"mode {mode!r}: use one of {WEIGHT_FORMATS}")
    xml, out_dir = Path(xml), Path(out_dir)
    if sensitivity_metric is not None and sensitivity_metric not in SENSITIVITY_METRICS:
        raise CompressionError(f"sensitivity_metric {sensitivity_metric!r}: use one of {SENSITIVITY_METRICS}")
    if gptq and lora_correction:
        raise CompressionError("gptq and lora_correction do not combine (NNCF): choose one")
    data_aware = needs_data(awq, scale_estimation, gptq, lora_correction, sensitivity_metric)
    if data_aware and not calibration_batches:
        raise CompressionError(
            "awq, scale_estimation, gptq, lora_correction and activation sensitivity need calibration_batches"
        )
    batches = calibration_batches or []
    kwargs: dict = {"mode": getattr(nncf.CompressWeightsMode, mode.upper())}
    if mode.startswith("int4"):
        kwargs.update(group_size=group_size, ratio=ratio)
        if sensitivity_metric is not None:
            kwargs["sensitivity_metric"] = getattr(nncf.SensitivityMetric, sensitivity_metric.upper())
        if data_aware:
            kwargs.update(
                dataset=nncf.Dataset(batches),
                awq=awq,
                scale_estimation=scale_estimation,
                gptq=gptq,
                lora_correction=lora_correction,
                subset_size=len(batches),
            )
        if lora_correction:
            from nncf.quantization.advanced_parameters import (
                AdvancedCompressionParameters,
                AdvancedLoraCorrectionParameters,
            )

            kwargs["advanced_parameters"] = AdvancedCompressionParameters(
                lora_correction_params=AdvancedLoraCorrectionParameters(
                    adapter_rank=lora_adapter_rank, subset_size=len(batches)
                )
            )
    if ignored_scope:
        kwargs["ignored_scope"] = nncf.IgnoredScope(
            names=list(ignored_scope.get("names", [])),
            types=list(ignored_scope.get("types", [])),
            patterns=list(ignored_scope.get("patterns", [])),
        )
    model = ov.Core().read_model(str(xml))
    try:
        compressed = nncf.compress_weights(model, **kwargs)
    except (
        nncf.errors.InvalidGroupSizeError,
        nncf.errors.ValidationError,
        nncf.errors.ParameterNotSupportedError,
        nncf.errors.UnsupportedModelError,
        ValueError,
        RuntimeError,
    ) as exc:
        raise CompressionError(f"NNCF {mode} group {group_size}: {_one_line(exc)}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() != xml.parent.resolve():
        for path in xml.parent.iterdir():
            if path.is_file() and path.name not in (xml.name, xml.with_suffix(".bin").name):
                shutil.copy2(path, out_dir / path.name)
    out = out_dir / IR_FILE
    ov.save_model(compressed, str(out), compress_to_fp16=False)
    return out


def needs_data(awq: bool, scale_estimation: bool, gptq: bool, lora_correction: bool, sensitivity_metric) -> bool:
    """Whether these NNCF settings read activations (calibration text) as well as weights."""
    activation_sensitivity = sensitivity_metric not in (None, "weight_quantization_error")
    return bool(awq or scale_estimation or gptq or lora_correction or activation_sensitivity)


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


_PRECISION_NAMES = {
    "u4": "int4",
    "i4": "int4",
    "u8": "int8",
    "i8": "int8",
    "f32": "float",
    "f16": "float",
    "bf16": "float",
}


def weight_precision(xml: str | Path) -> dict:
    """Which weights ended at which precision, {precision: {count, nodes}} (the shape of
    engines.onnxruntime_genai.build.weight_precision): every MatMul and Gather (the embedding) whose weight input
    is a constant, by the element type of that constant (u4/i4 -> int4, u8/i8 -> int8, else float);
    nodes are named like 'layers.3/self_attn/q_proj' or 'lm_head'."""
    import openvino as ov

    model = ov.Core().read_model(str(xml))
    groups: dict[str, list[str]] = {}
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind not in ("MatMul", "Gather"):
            continue
        port = 0 if kind == "Gather" else 1
        constant = _weight_constant(op.input_value(port).get_node())
        if constant is None:
            continue
        element = constant.get_output_element_type(0).get_type_name()
        groups.setdefault(_PRECISION_NAMES.get(element, element), []).append(_layer_name(op.get_friendly_name()))
    return {
        precision: {"count": len(names), "nodes": list(dict.fromkeys(names))} for precision, names in groups.items()
    }


def _weight_constant(node, depth: int = 0):
    """The Constant a weight input comes from, through NNCF's decompression subgraph (Convert,
    Subtract, Multiply, Reshape); None when the input is computed from activations."""
    kind = node.get_type_name()
    if kind == "Constant":
        shape = node.get_output_partial_shape(0)
        return node if shape.rank.get_length() >= 2 else None
    if depth > 6 or kind not in ("Convert", "Subtract", "Multiply", "Reshape", "Transpose"):
        return None
    return _weight_constant(node.input_value(0).get_node(), depth + 1)


def _layer_name(friendly: str) -> str:
    """'__module.lm.model.layers.3.self_attn.q_proj/aten::linear/MatMul' -> 'layers.3/self_attn/q_proj'."""
    import re

    name = friendly.split("/")[0]
    name = re.sub(r"^__module\.", "", name)
    name = re.sub(r"^(lm\.)?(model\.)?", "", name)
    name = re.sub(r"^(layers\.\d+)\.", r"\1/", name).replace(".", "/").replace("layers/", "layers.")
    return re.sub(r"^layers\.(\d+)/", r"layers.\1/", name)
