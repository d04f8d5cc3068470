"""Shape rules for models that take tensors (optimize/inputs.py): symbolic dims from the recipe, the
batch, or the model's metadata, never a silent default; constants and random ranges; the first-batch
probe; batches whose state carries the batch on another axis."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from optimize.errors import RecipeError
from optimize.evaluate.harness import batches_of, sample_count
from optimize.inputs import BATCH, Batch, TensorEncoder, plan_inputs

IMAGE = [{"name": "x", "type": "tensor(float)", "shape": ["n", 3, "h", "w"]}]
VAD = [
    {"name": "input", "type": "tensor(float)", "shape": ["batch", "sequence"]},
    {"name": "state", "type": "tensor(float)", "shape": [2, "batch", 128]},
    {"name": "sr", "type": "tensor(int64)", "shape": []},
]


def test_symbolic_dims_without_a_value_are_refused_naming_the_override():
    (plan,) = plan_inputs(IMAGE, {}, {})
    assert plan.dims == [BATCH, 3, None, None]
    with pytest.raises(RecipeError) as refused:
        TensorEncoder([plan]).random(2, 0)
    message = str(refused.value)
    assert "'x' dim 2 is symbolic (h)" in message and "model.inputs.x.shape=[N,3,...,...]" in message


def test_recipe_shape_then_batch_then_metadata():
    (plan,) = plan_inputs(IMAGE, {"x": {"shape": ["N", 3, 64, 96]}}, {})
    assert plan.shape(5) == [5, 3, 64, 96]
    (from_metadata,) = plan_inputs(IMAGE, {}, {"h": "32", "w": "48"})
    assert from_metadata.shape(2) == [2, 3, 32, 48]
    arrays = TensorEncoder([from_metadata]).random(3, seed=0)
    assert arrays["x"].shape == (3, 3, 32, 48) and arrays["x"].dtype == np.float32


def test_recipe_shapes_are_checked_against_the_graph():
    with pytest.raises(RecipeError, match="dim 1 is 4, the model fixes it at 3"):
        plan_inputs(IMAGE, {"x": {"shape": ["N", 4, 64, 64]}}, {})
    with pytest.raises(RecipeError, match="has 3 dims"):
        plan_inputs(IMAGE, {"x": {"shape": ["N", 3, 64]}}, {})
    with pytest.raises(RecipeError, match=r"names \['y'\], which the model does not take"):
        plan_inputs(IMAGE, {"y": {"shape": [1]}}, {})
    with pytest.raises(RecipeError, match=r"unknown keys \['shpe'\]"):
        plan_inputs(IMAGE, {"x": {"shpe": [1, 3, 4, 4]}}, {})
    with pytest.raises(RecipeError, match="dtype=complex64"):
        plan_inputs(IMAGE, {"x": {"dtype": "complex64"}}, {})


def test_constants_and_the_batch_on_another_axis():
    plans = plan_inputs(
        VAD, {"input": {"shape": ["N", 512], "low": -1, "high": 1}, "state": {"value": 0}, "sr": {"value": 16000}}, {}
    )
    encoder = TensorEncoder(plans)
    assert encoder.data_input.name == "input"
    batch = encoder.random(5, seed=0)
    assert batch["input"].shape == (5, 512) and -1 <= batch["input"].min() and batch["input"].max() < 1
    assert batch["state"].shape == (2, 5, 128) and not batch["state"].any()
    assert batch["sr"].shape == () and batch["sr"] == 16000 and batch["sr"].dtype == np.int64
    assert isinstance(batch, Batch) and batch.batch_axes == {"input": 0, "state": 1, "sr": None}
    pieces = batches_of(batch, 2)
    assert [sample_count(p) for p in pieces] == [2, 2, 1]
    assert pieces[2]["state"].shape == (2, 1, 128) and pieces[2]["sr"] == 16000


def test_data_items_feed_the_data_input_and_text_is_refused():
    plans = plan_inputs(VAD, {"state": {"value": 0}, "sr": {"value": 16000}}, {})
    encoder = TensorEncoder(plans)
    items = [np.full(512, i, np.float32) for i in range(3)]
    batch = encoder(items)
    assert batch["input"].shape == (3, 512) and batch["input"][2, 0] == 2 and batch["state"].shape == (2, 3, 128)
    with pytest.raises(RecipeError, match="gives text, and this model takes tensors"):
        encoder(["some text"])
    with pytest.raises(RecipeError, match="takes 1 dims per sample"):
        encoder([np.zeros((2, 512), np.float32)])


def test_integer_and_normal_ranges():
    spec = [
        {"name": "ids", "type": "tensor(int64)", "shape": ["b", 7]},
        {"name": "f", "type": "tensor(float)", "shape": ["b", 2000]},
    ]
    batch = TensorEncoder(plan_inputs(spec, {"ids": {"low": 5, "high": 9}, "f": {"mean": 3.0, "std": 0.5}}, {})).random(
        4, 0
    )
    assert batch["ids"].min() >= 5 and batch["ids"].max() < 9 and batch["ids"].dtype == np.int64
    assert abs(batch["f"].mean() - 3.0) < 0.05 and abs(batch["f"].std() - 0.5) < 0.05


def broadcast_model(path):
    """x [N, 3, H, W] + a [1, 3, 4, 4] constant: runs only when H = W = 4 (or 1), like a network
    whose sides must be multiples of its stride."""
    bias = helper.make_tensor("bias", TensorProto.FLOAT, [1, 3, 4, 4], [0.5] * 48)
    node = helper.make_node("Add", ["x", "bias"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.metadata_props.add(key="h", value="4")
    onnx.save(model, str(path))
    return path


def test_the_first_batch_runs_the_model_once_and_a_failure_names_the_shapes(tmp_path):
    path = broadcast_model(tmp_path / "m.onnx")
    good = TensorEncoder.for_onnx(path, {"x": {"shape": ["N", 3, 4, 4]}})
    assert good.random(2, 0)["x"].shape == (2, 3, 4, 4)
    with pytest.raises(RecipeError) as refused:
        TensorEncoder.for_onnx(path, {"x": {"shape": ["N", 3, 5, 5]}}).random(2, 0)
    assert "the model fails on the inputs x[1, 3, 5, 5] float32" in str(refused.value)
    # h comes from the model's metadata; w has no value anywhere: refused, never guessed.
    with pytest.raises(RecipeError, match=r"dim 3 is symbolic \(w\)"):
        TensorEncoder.for_onnx(path, {}).random(1, 0)
