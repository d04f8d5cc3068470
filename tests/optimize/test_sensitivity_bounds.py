"""The sensitivity fallback within a build's budget: on a deep model it keeps nodes FP32 in groups (fewer
whole-model quantizations), and past its time box it stops with the best set it has scored."""

from __future__ import annotations

import pytest

from optimize import deadline, registry
from optimize.context import Model
from optimize.quantize import sensitivity
from tests.optimize.test_quantize_methods import _tiny_mlp
from tests.support.context import onnx_context

pytest.importorskip("onnx")


def test_a_deep_model_keeps_nodes_fp32_in_groups_a_shallow_one_one_at_a_time():
    assert sensitivity.step_size(36) == 1  # MiniLM's quantizable nodes: one a step, as before
    assert sensitivity.step_size(48) == 1 and sensitivity.step_size(72) == 2 and sensitivity.step_size(144) == 3


def _fallback(tmp_path):
    (tmp_path / "src").mkdir()
    model = Model("torch", "generic").with_onnx(_tiny_mlp(tmp_path / "src" / "model.onnx"))
    method = registry.get("quantize", "ort_int8_dynamic")
    params = {"fallback_min_cosine": 1.0, "max_fp32_nodes": 1, "sensitivity_samples": 8}  # unreachable target
    return method.fn(model, registry.build_config(method, params), onnx_context(tmp_path))


def test_without_a_deadline_an_unreachable_target_stops_at_max_fp32_nodes(tmp_path):
    assert len(_fallback(tmp_path).record["fp32_nodes"]) == 1


def test_past_its_time_box_the_fallback_stops_with_the_best_it_scored(tmp_path, caplog):
    deadline.set_window(0.0)
    try:
        record = _fallback(tmp_path).record
    finally:
        deadline.clear()
    assert record["fp32_nodes"] == [] and record["calibration_min_cosine"] < 1.0  # only all-INT8 was scored
    assert "sensitivity fallback stopped at its time box (70% of the build budget)" in caplog.text
