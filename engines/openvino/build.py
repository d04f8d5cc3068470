"""Building OpenVINO IRs: ONNX -> IR, and NNCF post-training INT8. Pure functions over files and
arrays; the pipeline decides what to build and records it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

IR_FILE = "model.xml"


def no_telemetry() -> None:
    """OpenVINO's converter and NNCF send usage telemetry over the network unless they are told they
    run in CI; this tool builds models on offline and CI machines, so it says so with the libraries'
    own switches (NNCF reads its variable when imported: call this before the first import of nncf).
    On a machine without network the send failed in a child process and printed a traceback."""
    import os

    os.environ.setdefault("NNCF_CI", "1")
    os.environ.setdefault("CI", "true")


def ov_version() -> str:
    import openvino as ov

    return ov.get_version()


def save_ir(model, out_dir: str | Path) -> Path:
    """Write model.xml + model.bin. save_model compresses weights to FP16 unless told not to: an FP32
    (or INT8, whose scales and remaining FP weights are FP32) artifact must keep the numbers it was
    measured with."""
    import openvino as ov

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    xml_path = out / IR_FILE
    ov.save_model(model, str(xml_path), compress_to_fp16=False)
    return xml_path


def onnx_to_ir(onnx_path: str | Path, out_dir: str | Path) -> Path:
    """Convert an ONNX file to an FP32 IR in out_dir; returns model.xml (model.bin beside it).
    The ONNX input and output names become the IR's tensor names."""
    no_telemetry()
    import openvino as ov

    return save_ir(ov.convert_model(str(onnx_path)), out_dir)


def _read(xml_or_model):
    """An ov.Model as it is, or read from an IR path."""
    import openvino as ov

    if isinstance(xml_or_model, (str, Path)):
        return ov.Core().read_model(str(xml_or_model))
    return xml_or_model


def _ignored_scope(ignored_scope: Optional[dict]):
    """{'names': [...], 'types': [...], 'patterns': [...]} -> nncf.IgnoredScope. validate=True (the
    default) makes NNCF fail on a name or type the model does not have, rather than ignore a typo."""
    import nncf

    scope = ignored_scope or {}
    unknown = set(scope) - {"names", "types", "patterns"}
    if unknown:
        raise ValueError(f"ignored_scope keys {sorted(unknown)}: use names, types, patterns")
    return nncf.IgnoredScope(
        names=list(scope.get("names", [])), types=list(scope.get("types", [])), patterns=list(scope.get("patterns", []))
    )


def _quantization_settings(
    preset: str,
    model_type: Optional[str],
    subset_size: int,
    fast_bias_correction: bool,
    smooth_quant_alpha: Optional[float],
    ignored_scope: Optional[dict],
    target_device: str,
) -> dict:
    """Keyword arguments common to nncf.quantize and nncf.quantize_with_accuracy_control (NNCF 3.x)."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    advanced = None
    if smooth_quant_alpha is not None:
        # NNCF 3.x takes the alpha per layer kind; only MatMuls matter for transformers, and a
        # negative alpha turns SmoothQuant off.
        advanced = AdvancedQuantizationParameters(
            smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=smooth_quant_alpha)
        )
    return {
        "preset": nncf.QuantizationPreset(preset),
        "target_device": nncf.TargetDevice(target_device),
        "subset_size": subset_size,
        "fast_bias_correction": fast_bias_correction,
        "model_type": nncf.ModelType(model_type) if model_type else None,
        "ignored_scope": _ignored_scope(ignored_scope),
        "advanced": advanced,
    }


def nncf_int8(
    xml_or_model,
    calibration_batches: list[dict[str, np.ndarray]],
    out_dir: str | Path,
    *,
    preset: str = "mixed",
    model_type: Optional[str] = "transformer",
    subset_size: int = 300,
    fast_bias_correction: bool = True,
    smooth_quant_alpha: Optional[float] = None,
    ignored_scope: Optional[dict] = None,
    target_device: str = "CPU",
) -> Path:
    """NNCF post-training INT8 of an FP32 IR (path or ov.Model), calibrated on `calibration_batches`
    (named arrays, as a Runner takes them). `subset_size` counts batches, not samples: NNCF draws
    that many items from the dataset. preset 'mixed' quantizes activations asymmetrically (they are
    not centred after GELU/softmax), 'performance' symmetrically. Returns out_dir/model.xml."""
    no_telemetry()
    import nncf

    settings = _quantization_settings(
        preset, model_type, subset_size, fast_bias_correction, smooth_quant_alpha, ignored_scope, target_device
    )
    advanced = settings.pop("advanced")
    quantized = nncf.quantize(
        _read(xml_or_model), nncf.Dataset(calibration_batches), **settings, advanced_parameters=advanced
    )
    return save_ir(quantized, out_dir)


def nncf_int8_with_accuracy_control(
    xml_or_model,
    calibration_batches: list[dict[str, np.ndarray]],
    validation_batches: list,
    validate_fn: Callable[[object, Iterable], float | tuple[float, list[float]]],
    max_drop: float,
    out_dir: Optional[str | Path],
    *,
    preset: str = "mixed",
    model_type: Optional[str] = "transformer",
    subset_size: int = 300,
    fast_bias_correction: bool = True,
    smooth_quant_alpha: Optional[float] = None,
    ignored_scope: Optional[dict] = None,
    target_device: str = "CPU",
    max_iterations: Optional[int] = None,
    ranking_subset_size: Optional[int] = None,
    intermediate_model_dir: Optional[str | Path] = None,
):
    """INT8 like nncf_int8, then NNCF reverts quantized layers to FP32, most harmful first, until the
    metric is within `max_drop` (absolute) of the FP32 model's.

    `validate_fn(compiled_model, validation_items)` scores a compiled OpenVINO model (higher is
    better) and returns the score, or (score, one value per item): with the values NNCF ranks layers
    on the `ranking_subset_size` items the quantization hurt most (None: NNCF's default); without
    them it calls validate_fn on single items. NNCF compiles every model it scores in f32.
    `max_iterations` bounds how many reverts NNCF tries (None: NNCF's default, no bound).
    `intermediate_model_dir` receives NNCF's fully quantized model (intermediate_model.xml), before
    any revert. When max_drop cannot be reached NNCF only logs it and returns what it has (possibly
    every layer reverted), so the caller must measure the result, as the gate does. Returns
    out_dir/model.xml, or the ov.Model itself when out_dir is None.
    """
    no_telemetry()
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    settings = _quantization_settings(
        preset, model_type, subset_size, fast_bias_correction, smooth_quant_alpha, ignored_scope, target_device
    )
    advanced = settings.pop("advanced")
    restorer = AdvancedAccuracyRestorerParameters(
        ranking_subset_size=ranking_subset_size,
        intermediate_model_dir=str(intermediate_model_dir) if intermediate_model_dir is not None else None,
    )
    if max_iterations is not None:
        restorer.max_num_iterations = max_iterations
    quantized = nncf.quantize_with_accuracy_control(
        _read(xml_or_model),
        nncf.Dataset(calibration_batches),
        nncf.Dataset(validation_batches),
        validate_fn,
        max_drop=max_drop,
        drop_type=nncf.DropType.ABSOLUTE,
        **settings,
        advanced_quantization_parameters=advanced,
        advanced_accuracy_restorer_parameters=restorer,
    )
    return save_ir(quantized, out_dir) if out_dir is not None else quantized


def count_ops(xml_or_model) -> dict[str, int]:
    """How many nodes of each op type the model has (e.g. FakeQuantize after NNCF INT8)."""
    counts: dict[str, int] = {}
    for op in _read(xml_or_model).get_ops():
        kind = op.get_type_name()
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def weighted_node_precision(xml_or_model) -> dict[str, bool]:
    """{node name: runs INT8} over MatMuls and convolutions: INT8 when an input comes through a
    FakeQuantize (activations) or from an 8-bit constant (weights NNCF stored compressed)."""
    return {
        op.get_friendly_name(): any(
            _is_int8_input(op.input_value(i).get_node(), depth=4) for i in range(op.get_input_size())
        )
        for op in _read(xml_or_model).get_ops()
        if op.get_type_name() in ("MatMul", "Convolution")
    }


def int8_node_counts(xml_or_model) -> dict:
    """{'int8': n, 'float': m, 'by_op': {...}} over MatMuls and convolutions (weighted_node_precision)."""
    precision = weighted_node_precision(xml_or_model)
    int8 = sum(precision.values())
    floating = len(precision) - int8
    return {
        "int8": int8,
        "float": floating,
        "by_op": {"MatMul/Convolution INT8": int8, "MatMul/Convolution float": floating},
    }


def _is_int8_input(node, depth: int) -> bool:
    kind = node.get_type_name()
    if kind == "FakeQuantize":
        return True
    if kind == "Constant":
        return node.get_output_element_type(0).get_type_name() in ("i8", "u8")
    if depth == 0 or kind not in ("Convert", "Multiply", "Subtract", "Reshape", "Transpose"):
        return False
    return any(_is_int8_input(node.input_value(i).get_node(), depth - 1) for i in range(node.get_input_size()))
