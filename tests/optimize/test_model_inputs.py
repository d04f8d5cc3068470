"""Shape rules for models that take tensors (optimize/inputs/): symbolic dims from the recipe, the
batch, or the model's metadata, never a silent default; constants and random ranges; the first-batch
probe; batches whose state carries the batch on another axis."""

from __future__ import annotations

import re
import shlex

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from optimize.errors import RecipeError
from optimize.evaluate.harness import batches_of, sample_count
from optimize.inputs.encoder import Batch, TensorEncoder
from optimize.inputs.plan import BATCH, MAX_ITEM_ELEMENTS, plan_inputs

IMAGE = [{"name": "x", "type": "tensor(float)", "shape": ["n", 3, "h", "w"]}]
VAD = [
    {"name": "input", "type": "tensor(float)", "shape": ["batch", "sequence"]},
    {"name": "state", "type": "tensor(float)", "shape": [2, "batch", 128]},
    {"name": "sr", "type": "tensor(int64)", "shape": []},
]


def compose_inputs(*overrides: str) -> dict:
    """model.inputs as Hydra composes it from the command line's words."""
    from hydra import compose, initialize_config_dir

    from optimize.__main__ import CONFIG_DIR
    from optimize.config import recipe_dict, register_schema

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return recipe_dict(compose("config", overrides=list(overrides)).model.inputs)


def advised_override(message: str) -> str:
    """The override a refusal advises, as a shell would pass it (the message quotes it for one)."""
    (quoted,) = re.findall(r"add ('\+\+[^']*')", message)
    (word,) = shlex.split(quoted)
    return word


def test_symbolic_dims_without_a_value_are_refused_naming_the_override():
    (plan,) = plan_inputs(IMAGE, {}, {})
    assert plan.dims == [BATCH, 3, None, None]
    with pytest.raises(RecipeError) as refused:
        TensorEncoder([plan]).random(2, 0)
    message = str(refused.value)
    assert "'x' dim 2 is symbolic (h)" in message and "'++model.inputs.x.shape=[N,3,64,64]'" in message
    advice = advised_override(message)
    # The advice composes as written, whether the recipe sets model.inputs.x (ppocr_det does) or not.
    for recipe in ("model.source=model.onnx", "recipe=ppocr_det_int8_static"):
        given = compose_inputs(recipe, advice)
        assert given["x"]["shape"] == ["N", 3, 64, 64]
        (planned,) = plan_inputs(IMAGE, given, {})
        assert planned.shape(2) == [2, 3, 64, 64]


@pytest.mark.parametrize("name", ["input.1", "onnx::Conv_0", "0", "a b", "true"])
def test_the_advice_composes_for_names_that_are_not_plain_keys(name):
    # PyTorch's exporter names inputs input.1 or onnx::Conv_0: a dotted override would nest them.
    spec = [{"name": name, "type": "tensor(float)", "shape": ["n", "t"]}]
    with pytest.raises(RecipeError) as refused:
        TensorEncoder(plan_inputs(spec, {}, {})).random(1, 0)
    given = compose_inputs("model.source=model.onnx", advised_override(str(refused.value)))
    assert given == {name: {"shape": ["N", 64]}}
    assert plan_inputs(spec, given, {})[0].shape(3) == [3, 64]


def test_a_name_hydra_cannot_take_is_pointed_at_a_recipe():
    spec = [{"name": "entrée", "type": "tensor(float)", "shape": ["n", "t"]}]
    with pytest.raises(RecipeError, match=r"shape: \[N,64\] under model.inputs\['entrée'\] in a recipe"):
        TensorEncoder(plan_inputs(spec, {}, {})).random(1, 0)


@pytest.mark.parametrize(
    "dim, shown",
    [(8.5, "8.5"), (8.0, "8.0"), (-4, "-4"), (0, "0"), (True, "True"), ("...", "'...'"), ("64", "'64'")],
)
def test_a_recipe_dim_is_a_positive_whole_number_or_a_name(dim, shown):
    # 8.5 used to become 8 without a word; -4 reached numpy (ValueError); "..." was taken for the batch.
    with pytest.raises(RecipeError) as refused:
        plan_inputs(IMAGE, {"x": {"shape": ["N", 3, dim, 64]}}, {})
    assert str(refused.value) == (
        f"model.inputs.x.shape dim 2 is {shown}: a dim is a positive whole number, or a name such as N for the batch"
    )
    with pytest.raises(RecipeError, match=r"model.inputs.x.shape=64 \(give a list of dims"):
        plan_inputs(IMAGE, {"x": {"shape": 64}}, {})


@pytest.mark.parametrize(
    "shape, dim, shown",
    [
        (["N", 3, 10**30, 64], 2, "beyond int64"),
        (["N", 3, 2**62, 64], 2, str(2**62)),
        (["N", 3, 100_000, 100_000], 3, "100000"),
        (["N", 3, 10**5000, 64], 2, "beyond int64"),  # one Python cannot even print
    ],
)
def test_a_sample_over_the_cpu_bound_is_refused_naming_the_dim(shape, dim, shown):
    # These used to reach numpy: MemoryError for 3x100000x100000, ValueError past int64.
    with pytest.raises(RecipeError) as refused:
        plan_inputs(IMAGE, {"x": {"shape": shape}}, {})
    message = str(refused.value)
    assert message.startswith(f"model input 'x' dim {dim} is {shown}: one sample of x[N,3,")
    assert f"over {MAX_ITEM_ELEMENTS} elements, more than a CPU run can hold" in message
    # The bound is on one sample, batch left out: 3 x 4096 x 5461 is just under it, 5462 just over.
    (fits,) = plan_inputs(IMAGE, {"x": {"shape": ["N", 3, 4096, 5461]}}, {})
    assert 3 * 4096 * 5461 <= MAX_ITEM_ELEMENTS < 3 * 4096 * 5462 and fits.dims == [BATCH, 3, 4096, 5461]
    with pytest.raises(RecipeError, match="'x' dim 3 is 5462"):
        plan_inputs(IMAGE, {"x": {"shape": ["N", 3, 4096, 5462]}}, {})


def test_the_graph_and_its_metadata_are_bounded_too():
    huge = [{"name": "x", "type": "tensor(float)", "shape": ["n", 2**40]}]
    with pytest.raises(RecipeError, match=f"'x' dim 1 is {2**40}: one sample of x\\[N,{2**40}\\]"):
        plan_inputs(huge, {}, {})
    with pytest.raises(RecipeError, match="'x' dim 3 is 100000: one sample"):
        plan_inputs(IMAGE, {}, {"h": "100000", "w": "100000"})
    # Only a positive integer entry sets a dim: "0", "-3" or a superscript two leave it to the recipe.
    for value in ("0", "-3", "\u00b2", "4.5", "9" * 40):
        (plan,) = plan_inputs(IMAGE, {}, {"h": value, "w": "4"})
        assert plan.dims == [BATCH, 3, None, 4], value


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
