"""Engine: OpenVINO on the CPU, in FP32, bf16 (where the CPU has native bf16) or NNCF post-training INT8.

The model goes through the ONNX export first (the same export, checked against PyTorch, that the
onnx engine ships), then `openvino.convert_model` turns it into IR (model.xml + model.bin, weights
kept FP32). bf16 is an inference precision, not a weight format: the IR stays FP32 and the engine
block tells the runtime to compute in bf16, which the runtime refuses on a CPU without it.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from typing import List, Optional

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register, takes_tensors

log = logging.getLogger(__name__)
PRECISIONS = ("f32", "bf16", "int8")
ENGINE_DIR = "openvino"


@dataclass
class OpenVINOConfig:
    """Example recipe (NNCF INT8, two MatMuls kept in FP32):

    engine:
      method: openvino
      params: {precision: int8, ignored_names: [/encoder/layer.5/output/dense/MatMul]}
    """

    precision: str = "f32"  # f32 | bf16 (inference precision) | int8 (NNCF post-training quantization)
    performance_hint: str = "LATENCY"  # LATENCY | THROUGHPUT (the CPU plugin's stream/thread layout)
    ort_fusions: bool = True  # convert the ORT-fused export (OpenVINO reads com.microsoft ops; measured faster)
    # NNCF INT8 (precision=int8)
    calibration_count: int = 100  # calibration items (at most calibration.count)
    calibration_batch: int = 1  # items per calibration batch; NNCF's statistics are per batch
    preset: str = "mixed"  # mixed: asymmetric activations (not centred after GELU/softmax) | performance
    model_type: Optional[str] = "transformer"  # transformer: NNCF's transformer-aware scheme | null
    fast_bias_correction: bool = True
    smooth_quant_alpha: Optional[float] = None  # SmoothQuant alpha for MatMuls; negative turns it off
    ignored_names: List[str] = field(default_factory=list)  # nodes kept in FP32 (OpenVINO names)
    ignored_types: List[str] = field(default_factory=list)
    ignored_patterns: List[str] = field(default_factory=list)

    def validate(self):
        if self.precision not in PRECISIONS:
            raise RecipeError(f"engine.params.precision={self.precision} (use {', '.join(PRECISIONS)})")
        if self.performance_hint not in ("LATENCY", "THROUGHPUT"):
            raise RecipeError(f"engine.params.performance_hint={self.performance_hint} (use LATENCY or THROUGHPUT)")
        if self.preset not in ("mixed", "performance"):
            raise RecipeError(f"engine.params.preset={self.preset} (use mixed or performance)")
        if min(self.calibration_count, self.calibration_batch) < 1:
            raise RecipeError("engine.params.calibration_count and calibration_batch must be at least 1")
        from engines.openvino.runner import openvino_missing

        packages = {"openvino": "openvino", **({"nncf": "nncf"} if self.precision == "int8" else {})}
        missing = openvino_missing(packages, bf16=self.precision == "bf16")
        if missing:  # checked before any weights load
            raise RecipeError(f"engine.method=openvino precision={self.precision}: {missing}")

    def ignored_scope(self) -> dict:
        return {"names": self.ignored_names, "types": self.ignored_types, "patterns": self.ignored_patterns}


@register(
    "engine",
    "openvino",
    OpenVINOConfig,
    input_format="torch",
    tasks=takes_tensors,
    engine_formats=(formats.OPENVINO,),
)
def openvino_engine(model: Model, cfg: OpenVINOConfig, ctx: Context) -> Model:
    """OpenVINO IR on the CPU: FP32, bf16 inference precision, or NNCF post-training INT8."""
    from engines.openvino.build import nncf_int8, onnx_to_ir, ov_version
    from optimize.compile.onnx import OnnxExportConfig, onnx_engine

    exported = model if model.kind == "onnx" else onnx_engine(model, OnnxExportConfig(ort_fusions=cfg.ort_fusions), ctx)
    out = ctx.scratch / "openvino_engine"
    shutil.rmtree(out, ignore_errors=True)
    xml = onnx_to_ir(exported.onnx_file(), out / "fp32")
    if cfg.precision == "int8":
        batches = _calibration_batches(ctx, cfg)
        log.info("NNCF INT8: calibrating on %d batches", len(batches))
        xml = nncf_int8(
            xml,
            batches,
            out / "int8",
            preset=cfg.preset,
            model_type=cfg.model_type,
            subset_size=len(batches),
            fast_bias_correction=cfg.fast_bias_correction,
            smooth_quant_alpha=cfg.smooth_quant_alpha,
            ignored_scope=cfg.ignored_scope(),
        )
    final = out / ENGINE_DIR
    shutil.move(str(xml.parent), str(final))
    from engines.openvino.build import int8_node_counts

    ops, kernels = _op_counts(final / xml.name), int8_node_counts(final / xml.name)
    record = {
        "method": "openvino",
        "precision": cfg.precision,
        "openvino": ov_version(),
        "performance_hint": cfg.performance_hint,
        "onnx_export": exported.record,  # empty when the model came as ONNX
        "ops": ops,
        "kernels": kernels,
        **({"nncf": _nncf_record(cfg)} if cfg.precision == "int8" else {}),
    }
    engine = {
        "format": formats.OPENVINO,
        "file": f"{ENGINE_DIR}/{xml.name}",
        "inference_precision": "bf16" if cfg.precision == "bf16" else "f32",
        "performance_hint": cfg.performance_hint,
    }
    shutil.rmtree(out / "fp32", ignore_errors=True)
    return model.with_engine(out, engine, precision=cfg.precision).recorded(record)


def _calibration_batches(ctx, cfg: OpenVINOConfig) -> list[dict]:
    from optimize.evaluate.harness import batches_of

    count = min(cfg.calibration_count, len(ctx.calibration().items))
    return batches_of(ctx.calibration_inputs(count), cfg.calibration_batch)


def _op_counts(xml) -> dict:
    """The op types that say what runs: FakeQuantize (INT8) against the MatMuls and convolutions."""
    from engines.openvino.build import count_ops

    counts = count_ops(xml)
    return {op: counts[op] for op in ("MatMul", "Convolution", "FakeQuantize") if op in counts}


def _nncf_record(cfg: OpenVINOConfig) -> dict:
    from importlib import metadata

    return {
        "nncf": metadata.version("nncf"),
        "preset": cfg.preset,
        "model_type": cfg.model_type,
        "calibration_count": cfg.calibration_count,
        "fast_bias_correction": cfg.fast_bias_correction,
        "smooth_quant_alpha": cfg.smooth_quant_alpha,
        "ignored_scope": cfg.ignored_scope(),
    }
