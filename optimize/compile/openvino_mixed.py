"""Engine: OpenVINO with INT8 where it is safe and float where it is not, chosen by NNCF.

NNCF's accuracy-aware post-training quantization (`nncf.quantize_with_accuracy_control`) quantizes
the whole model as the openvino engine's int8 does, scores it with a validation function, ranks the
quantized layers by how much each costs that score, and reverts the worst to float until the score
is within `max_drop` of the FP32 model's. The score here is the cosine of the task's deciding output
(the sentence embedding, the logits) to the FP32 IR's, its minimum (or mean) over calibration texts:
the gate's evaluation texts are never shown to the search, so the gate still judges held-out data.
The bar is the gate's own (min_cosine, or min_mean_cosine for the mean) plus a margin, since NNCF
scores in f32 on other texts than the gate's. The reverted layers then compute in bf16 where the CPU
has native bf16 (as openvino_bf16 does), f32 otherwise; the INT8 layers are INT8 either way.

In the race the search is time-boxed (optimize/deadline.py): once what is left of the candidate's
build budget is only what writing the result takes (the rebuild repeats NNCF's first quantization, so
1.5 times that, plus 5 s, and at least RESERVE_SHARE of the budget), NNCF stops at its next check
with the layers reverted so far (a revert it is scoring is taken as the last), or, while it is still
ranking layers, the plain INT8 IR ships with none reverted; the record says which
(accuracy_control.stopped). Without it, a 110M-parameter encoder's search on 2 cores re-ranked every
layer after each revert that made things worse, and ran for more than 37 minutes.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from engines import formats
from optimize.context import Context, Model
from optimize.errors import RecipeError
from optimize.registry import register

log = logging.getLogger(__name__)
ENGINE_DIR = "openvino"
METRICS = ("min", "mean")
INFERENCE_PRECISIONS = ("auto", "bf16", "f32")
GATE_BAR = {"min": "min_cosine", "mean": "min_mean_cosine"}
# What the search leaves of the build's budget to quantize the chosen IR afresh (NNCF's statistics a
# second time), score and write it: 1.5 times NNCF's first quantization and 5 s, at least this share.
# MiniLM's whole build took 90 s of its 150 s on a busy 2-core machine, its first quantization ~15 s.
RESERVE_SHARE = 0.15


class _TimeBoxed(Exception):
    """The search's time box ran out while NNCF was ranking layers (no model of its to keep)."""


@dataclass
class OpenVINOMixedConfig:
    """Example recipe (restore the mean cosine to 0.998 instead of the gate's min cosine):

    engine:
      method: openvino_mixed
      params: {metric: mean, min_cosine: 0.998}
    """

    metric: str = "min"  # min | mean cosine to the FP32 model over the validation texts
    # The score NNCF restores: null takes the gate's threshold for the metric (gate.min_cosine or
    # gate.min_mean_cosine) plus `margin`.
    min_cosine: Optional[float] = None
    margin: float = 0.003  # above the gate's bar: NNCF scores in f32 on the calibration texts
    validation_count: int = 64  # calibration texts NNCF scores on (at most calibration.count)
    ranking_subset_size: Optional[int] = 8  # the texts quantization hurt most, on which NNCF ranks layers
    max_reverted: Optional[int] = None  # at most this many reverts (null: until the bar holds)
    inference_precision: str = "auto"  # auto: bf16 where the CPU has native bf16, else f32 | bf16 | f32
    performance_hint: str = "LATENCY"
    ort_fusions: bool = True
    calibration_count: int = 100  # calibration items for NNCF's statistics (at most calibration.count)
    preset: str = "mixed"
    model_type: Optional[str] = "transformer"
    fast_bias_correction: bool = True
    # Off: NNCF reverts a layer by restoring its original weights, while SmoothQuant's scale on the
    # layer's input stays in the graph, so a reverted smoothed layer computes with mismatched scales
    # (on a 5-layer MLP every revert lowered the cosine, to -0.03 with all reverted; without
    # SmoothQuant each revert raised it). A positive alpha turns it back on for MatMuls.
    smooth_quant_alpha: Optional[float] = -1.0

    def validate(self):
        if self.metric not in METRICS:
            raise RecipeError(f"engine.params.metric={self.metric} (use {' or '.join(METRICS)})")
        if self.inference_precision not in INFERENCE_PRECISIONS:
            raise RecipeError(
                f"engine.params.inference_precision={self.inference_precision} (use {', '.join(INFERENCE_PRECISIONS)})"
            )
        if self.min_cosine is not None and not 0 < self.min_cosine <= 1:
            raise RecipeError(f"engine.params.min_cosine={self.min_cosine} must be in (0, 1]")
        counts = (self.validation_count, self.calibration_count, self.ranking_subset_size, self.max_reverted)
        if any(n is not None and n < 1 for n in counts):
            raise RecipeError(
                "engine.params: validation_count, calibration_count, ranking_subset_size, max_reverted >= 1"
            )
        if self.preset not in ("mixed", "performance"):
            raise RecipeError(f"engine.params.preset={self.preset} (use mixed or performance)")
        from engines.openvino.runner import openvino_missing

        missing = openvino_missing({"openvino": "openvino", "nncf": "nncf"}, bf16=self.inference_precision == "bf16")
        if missing:
            raise RecipeError(f"engine.method=openvino_mixed: {missing}")

    def compute_precision(self) -> str:
        """The precision the float layers run in: bf16 only where the CPU plugin has it natively."""
        from engines.openvino.runner import bf16_supported

        if self.inference_precision == "auto":
            return "bf16" if bf16_supported() else "f32"
        return self.inference_precision


@register(
    "engine",
    "openvino_mixed",
    OpenVINOMixedConfig,
    needs_calibration=True,
    input_format="torch",
    tasks=("sentence_embedding", "image_classification", "generic"),
    engine_formats=(formats.OPENVINO,),
)
def openvino_mixed_engine(model: Model, cfg: OpenVINOMixedConfig, ctx: Context) -> Model:
    """OpenVINO INT8 with the layers NNCF's accuracy control reverts kept in bf16 (f32 without bf16)."""
    from engines.openvino.build import onnx_to_ir
    from optimize.compile.onnx import OnnxExportConfig, onnx_engine

    output, bar, compute = _deciding_output(model.task), _bar(cfg, ctx), cfg.compute_precision()
    exported = model if model.kind == "onnx" else onnx_engine(model, OnnxExportConfig(ort_fusions=cfg.ort_fusions), ctx)
    out = ctx.scratch / "openvino_mixed_engine"
    shutil.rmtree(out, ignore_errors=True)
    fp32 = onnx_to_ir(exported.onnx_file(), out / "fp32")
    calibration, validation = _data(ctx, cfg, fp32, output)
    log.info("NNCF accuracy control: %s cosine >= %.4f on %d calibration texts", cfg.metric, bar, len(validation))
    xml, layers, stopped = _quantize(fp32, calibration, validation, output, bar, cfg, out)
    score = _score(xml, validation, output, cfg.metric)
    reverted = layers.get(compute, {}).get("count", 0)
    precision = f"int8+{compute}" if reverted else "int8"
    record = _record(
        cfg,
        xml,
        precision,
        exported.record,  # empty when the model came as ONNX
        control={
            "nncf": _nncf_version(),
            "metric": f"{cfg.metric} cosine of {output} to the FP32 IR (scored in f32)",
            "bar": round(bar, 6),
            "score": round(score, 6),
            "reached": score >= bar,
            "validation": f"{len(validation)} calibration texts",
            "reverted": reverted,
            "reverted_layers": layers.get(compute, {}).get("nodes", []),
            "smooth_quant_alpha": cfg.smooth_quant_alpha,
            "stopped": stopped,
        },
    )
    engine = {
        "format": formats.OPENVINO,
        "file": f"{ENGINE_DIR}/{xml.name}",
        "inference_precision": compute,
        "performance_hint": cfg.performance_hint,
    }
    built = model.with_engine(out, engine, precision=precision)
    return dataclasses.replace(built, layer_precision=layers).recorded(record)


def _quantize(
    fp32: Path, calibration, validation, output: str, bar: float, cfg, out: Path
) -> tuple[Path, dict, Optional[str]]:
    """NNCF's accuracy control picks the layers to keep float; then the IR is quantized afresh with
    those layers in NNCF's ignored scope, into out/openvino, so what ships is a plain NNCF INT8 IR
    with a recorded ignored scope (none reverted: NNCF's own INT8 model, quantized with the same
    settings, is moved there instead of quantizing again). On MiniLM (6 of 32 layers reverted) NNCF's last in-memory
    validation said min cosine 0.994 on the calibration texts while the saved IR, NNCF's own or this
    rebuild, scores 0.985 on them when read back (not explained yet; mean 0.9967 either way): the
    record keeps the saved IR's score, and the race judges it on the evaluation texts.
    Returns the IR, {precision: {count, nodes}} and how the time box stopped the search (None: it did
    not); leaves only the engine folder."""
    from engines.openvino.build import nncf_int8, nncf_int8_with_accuracy_control, weighted_node_precision

    settings = {
        "preset": cfg.preset,
        "model_type": cfg.model_type,
        "subset_size": len(calibration),
        "fast_bias_correction": cfg.fast_bias_correction,
        "smooth_quant_alpha": cfg.smooth_quant_alpha,
    }
    stopped: dict = {}
    try:
        chosen = nncf_int8_with_accuracy_control(
            fp32,
            calibration,
            validation,
            _time_boxed(_validation_fn(output, cfg.metric), len(validation), stopped),
            max_drop=1.0 - bar,
            out_dir=None,
            max_iterations=cfg.max_reverted,
            ranking_subset_size=min(cfg.ranking_subset_size or len(validation), len(validation)),
            intermediate_model_dir=out,
            **settings,
        )
    except _TimeBoxed:
        chosen = None
    quantized = weighted_node_precision(out / "intermediate_model.xml")
    kept_float = []
    if chosen is not None:
        kept_float = [n for n, is_int8 in weighted_node_precision(chosen).items() if not is_int8 and quantized.get(n)]
    if stopped:
        stopped["reverted"] = len(kept_float)
        log.warning("NNCF accuracy control: %s", _stopped_words(stopped))
    if kept_float:
        xml = nncf_int8(fp32, calibration, out / ENGINE_DIR, ignored_scope={"names": kept_float}, **settings)
    else:  # nothing reverted: NNCF's own INT8 model (the same settings, unweighted FP32 kept) is that IR
        xml = _moved_ir(out / "intermediate_model.xml", out / ENGINE_DIR)
    layers = _layers(quantized, weighted_node_precision(xml), cfg)
    shutil.rmtree(out / "fp32")
    for leftover in out.glob("intermediate_model.*"):
        leftover.unlink()
    return xml, layers, (_stopped_words(stopped) if stopped else None)


def _moved_ir(xml: Path, into: Path) -> Path:
    from engines.openvino.build import IR_FILE

    into.mkdir(parents=True, exist_ok=True)
    xml.with_suffix(".bin").replace(into / Path(IR_FILE).with_suffix(".bin").name)
    return xml.replace(into / IR_FILE)


def _time_boxed(validate, full_count: int, stopped: dict):
    """NNCF's validation function, within the build's time box: once only the reserve is left, a full
    validation (NNCF's check after a revert) answers a perfect score so NNCF returns the model it has,
    and any other (ranking layers on a subset) stops the search; `stopped` says where. NNCF quantizes,
    validates the FP32 model, then the quantized one: the time to that second full call measures the
    quantization and the scoring that writing the result repeats."""
    import time

    from optimize import deadline

    started, reserve = time.monotonic(), {"s": 0.0}

    def validate_within(compiled, items):
        items = list(items)
        full = len(items) == full_count
        if full and "quantized" not in reserve and "fp32" in reserve:
            reserve["quantized"] = 1.5 * (time.monotonic() - started) + 5.0
        reserve.setdefault("fp32", 0.0)
        left, window = deadline.seconds_left(), deadline.window_s()
        if left is None or window is None or left > max(reserve.get("quantized", 0.0), RESERVE_SHARE * window):
            return validate(compiled, items)
        if full:
            stopped.setdefault("where", "after a revert")
            return 1.0, [1.0] * len(items)
        stopped["where"] = "while ranking layers"
        raise _TimeBoxed()

    return validate_within


def _stopped_words(stopped: dict) -> str:
    if not stopped.get("reverted"):
        when = "while ranking layers" if stopped["where"] == "while ranking layers" else "before any revert"
        return f"stopped at its time box {when}: the INT8 IR ships with none reverted"
    return f"stopped at its time box: the best found so far ships, {stopped['reverted']} reverted"


def _deciding_output(task_name: str) -> str:
    from optimize import tasks

    output = tasks.get(task_name).fidelity_output
    if output is None:
        raise RecipeError(
            f"engine.method=openvino_mixed scores one deciding output (a sentence embedding, logits); "
            f"model.task={task_name} compares every output"
        )
    return output


def _bar(cfg: OpenVINOMixedConfig, ctx) -> float:
    """The cosine NNCF restores: the recipe's, else the gate's threshold for the metric plus the margin."""
    if cfg.min_cosine is not None:
        return cfg.min_cosine
    gate_key = GATE_BAR[cfg.metric]
    threshold = ctx.plan.gate[gate_key]
    if threshold is None:
        raise RecipeError(
            f"engine.method=openvino_mixed metric={cfg.metric}: set engine.params.min_cosine or gate.{gate_key}"
        )
    return min(1.0, float(threshold) + cfg.margin)


def _data(ctx, cfg: OpenVINOMixedConfig, fp32_xml: Path, output: str) -> tuple[list[dict], list[tuple]]:
    """Calibration batches of one item, and validation items (inputs, the FP32 IR's output)."""
    from engines.openvino.runner import OpenVINORunner
    from optimize.evaluate.harness import batches_of

    available = len(ctx.calibration().items)
    calibration = batches_of(ctx.calibration_inputs(min(cfg.calibration_count, available)), 1)
    validation = [_unpadded(item) for item in calibration[: min(cfg.validation_count, available)]]
    reference = OpenVINORunner(fp32_xml, threads=ctx.threads, inference_precision="f32")
    return calibration, [(item, reference(item)[output]) for item in validation]


def _unpadded(item: dict) -> dict:
    """A one-text item cut to its tokens: NNCF scores every ranked layer on these, and the padding
    the encoder adds (to max_length) only costs time, since attention and pooling mask it out and the
    INT8 ranges are fixed. Items without an attention mask are kept as they are."""
    mask = item.get("attention_mask")
    if mask is None or mask.ndim != 2 or mask.shape[0] != 1:
        return item
    length = max(int(mask.sum()), 1)
    return {k: v[:, :length] if v.ndim >= 2 and v.shape[1] == mask.shape[1] else v for k, v in item.items()}


def _validation_fn(output: str, metric: str):
    """NNCF's validation function: (score, one cosine per item) of a compiled model's `output`."""

    def validate(compiled, items) -> tuple[float, list[float]]:
        port = compiled.output(output)
        values = [_cosine(compiled(inputs)[port], reference) for inputs, reference in items]
        return (min(values) if metric == "min" else float(np.mean(values))), values

    return validate


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def _score(xml: Path, validation: list[tuple], output: str, metric: str) -> float:
    """The result scored as NNCF scored it (f32): NNCF only logs when it could not reach the bar."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return _validation_fn(output, metric)(compiled, validation)[0]


def _layers(quantized: dict[str, bool], mixed: dict[str, bool], cfg: OpenVINOMixedConfig) -> dict:
    """{precision: {count, nodes}}: the weighted nodes left INT8, those NNCF reverted (they compute
    in the float precision), and those NNCF never quantized."""
    float_precision = cfg.compute_precision()
    groups = {
        "int8": [n for n, is_int8 in mixed.items() if is_int8],
        float_precision: [n for n, is_int8 in mixed.items() if not is_int8 and quantized.get(n)],
        f"{float_precision} (never quantized)": [
            n for n, is_int8 in mixed.items() if not is_int8 and not quantized.get(n)
        ],
    }
    return {precision: {"count": len(nodes), "nodes": nodes} for precision, nodes in groups.items() if nodes}


def _nncf_version() -> str:
    from importlib import metadata

    return metadata.version("nncf")


def _record(cfg: OpenVINOMixedConfig, xml: Path, precision: str, export_record: dict, control: dict) -> dict:
    from engines.openvino.build import count_ops, int8_node_counts, ov_version

    counts = count_ops(xml)
    if not control["reached"]:
        log.warning(
            "NNCF accuracy control stopped at %s cosine %.4f, below its bar %.4f",
            cfg.metric,
            control["score"],
            control["bar"],
        )
    return {
        "method": "openvino_mixed",
        "precision": precision,
        "inference_precision": cfg.compute_precision(),
        "openvino": ov_version(),
        "performance_hint": cfg.performance_hint,
        "onnx_export": export_record,
        "ops": {op: counts[op] for op in ("MatMul", "Convolution", "FakeQuantize") if op in counts},
        "kernels": {**int8_node_counts(xml), "reverted": control["reverted"]},
        "accuracy_control": {**control, "preset": cfg.preset, "model_type": cfg.model_type},
    }
