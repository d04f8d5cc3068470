"""engine=openvino_mixed: NNCF's accuracy control on a tiny in-process encoder-like graph (real OpenVINO
and NNCF, seconds on 2 cores), and the candidate in the engine race on MiniLM."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino nncf)")
pytest.importorskip("nncf")
onnx = pytest.importorskip("onnx")

from optimize import registry  # noqa: E402
from optimize.compile.race.candidates import CANDIDATES, default_candidates  # noqa: E402
from optimize.context import Context, Model  # noqa: E402
from optimize.errors import RecipeError  # noqa: E402
from tests.support.context import onnx_context  # noqa: E402

WIDTH, LAYERS = 64, 4


def _tiny_embedder(path: Path, seed: int = 0) -> Path:
    """x[N, 64] -> LAYERS x (MatMul -> Add -> Relu) -> MatMul -> sentence_embedding[N, 64], seeded.
    Heavy-tailed inputs make the INT8 error differ from layer to layer, so there is something to rank."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, feed = [], [], "x"
    for i in range(LAYERS):
        inits += [
            numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 6).astype(np.float32), f"w{i}"),
            numpy_helper.from_array((rng.standard_normal(WIDTH) / 10).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [feed, f"w{i}"], [f"m{i}"], name=f"fc{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"bias{i}"),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        feed = f"r{i}"
    inits.append(numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 6).astype(np.float32), "w_out"))
    nodes.append(helper.make_node("MatMul", [feed, "w_out"], ["sentence_embedding"], name="fc_out"))
    graph = helper.make_graph(
        nodes,
        "tiny_embedder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Model:
    folder = tmp_path_factory.mktemp("src")
    return Model("torch", "sentence_embedding").with_onnx(_tiny_embedder(folder / "model.onnx"))


def _ctx(tmp_path: Path, min_cosine: float | None = 0.99) -> Context:
    items = [np.random.default_rng(i).standard_t(2, WIDTH).astype(np.float32) for i in range(24)]
    cosine = "null" if min_cosine is None else min_cosine
    return onnx_context(tmp_path, f"gate.min_cosine={cosine}", "gate.min_mean_cosine=null", items=items)


def _build(model: Model, ctx, **params):
    method = registry.get("engine", "openvino_mixed")
    return method.fn(model, registry.build_config(method, {"inference_precision": "f32", **params}), ctx)


def _cosines(built, source: Model, ctx) -> np.ndarray:
    """Per item: the built engine's embedding against the FP32 source's (ONNX Runtime)."""
    from engines import load_engine
    from engines.onnxruntime.runner import OrtRunner

    inputs = ctx.calibration_inputs(len(ctx.calibration().items))
    got = load_engine(built.engine_dir, built.engine, threads=1)(inputs)["sentence_embedding"]
    want = OrtRunner(source.onnx_path)(inputs)["sentence_embedding"]
    return (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))


def test_a_tight_bar_reverts_layers_to_float_and_the_score_reaches_it(embedder, tmp_path):
    ctx = _ctx(tmp_path)
    built = _build(embedder, ctx, min_cosine=0.9995, ranking_subset_size=8)
    record = built.record
    control = record["accuracy_control"]
    assert control["reverted"] >= 1 and control["reached"] and control["score"] >= 0.9995
    assert record["kernels"]["reverted"] == control["reverted"] == len(control["reverted_layers"])
    assert built.precision == "int8+f32" and built.engine["inference_precision"] == "f32"
    assert built.layer_precision["f32"]["count"] == control["reverted"]
    # OpenVINO names a MatMul after its ONNX node, the last one after the graph output
    assert set(control["reverted_layers"]) <= {f"fc{i}" for i in range(LAYERS)} | {"sentence_embedding"}
    assert _cosines(built, embedder, ctx).min() >= 0.9995 - 1e-4  # the artifact scores what NNCF scored
    assert not (built.engine_dir / "fp32").exists() and not list(built.engine_dir.glob("intermediate_model.*"))


def test_a_loose_bar_keeps_every_layer_int8(embedder, tmp_path):
    ctx = _ctx(tmp_path, min_cosine=0.5)
    built = _build(embedder, ctx, margin=0.0)
    control = built.record["accuracy_control"]
    assert control["bar"] == 0.5 and control["reverted"] == 0 and control["reverted_layers"] == []
    assert built.precision == "int8" and built.layer_precision["int8"]["count"] >= 1
    assert built.record["kernels"]["int8"] >= 1


def test_the_bar_comes_from_the_gate_and_is_refused_without_one(embedder, tmp_path):
    method = registry.get("engine", "openvino_mixed")
    with pytest.raises(RecipeError, match="gate.min_mean_cosine"):
        method.fn(embedder, registry.build_config(method, {"metric": "mean"}), _ctx(tmp_path))
    with pytest.raises(RecipeError, match="metric=median"):
        registry.build_config(method, {"metric": "median"})
    generic = Model("torch", "generic").with_onnx(embedder.onnx_path)
    with pytest.raises(RecipeError, match="deciding output"):
        method.fn(generic, registry.build_config(method, {}), _ctx(tmp_path))


def test_the_race_registers_it_in_its_default_set():
    assert CANDIDATES["openvino_mixed"].engine == "openvino_mixed"
    assert "openvino_mixed" in default_candidates(generates=False)
    assert registry.get("engine", "openvino_mixed").needs_calibration


def test_the_race_builds_scores_and_reports_it_on_minilm(minilm_default_race):
    # The default recipe's race (the session's, tests/conftest.py): openvino_mixed is one of its
    # candidates, built afresh against the recipe's own accuracy bar.
    proc, out = minilm_default_race.proc, minilm_default_race.artifact
    race = json.loads((out / "manifest.json").read_text())["stages"]["engine"]
    mixed = next(c for c in race["candidates"] if c["name"] == "openvino_mixed")
    assert mixed["kernels"]["int8"] > 0 and mixed["fidelity"]["cosine_min"] > 0.9
    assert "reverted" in mixed["kernels"]
    # the race table the run prints: the candidate's row says how many layers NNCF reverted
    row = next(line for line in proc.stdout.splitlines() if line.startswith("openvino_mixed "))
    assert f"({mixed['kernels']['reverted']} reverted)" in row


def test_past_its_time_box_the_search_stops_with_what_it_has_and_says_so(embedder, tmp_path):
    """The bar that reverts layers above, with the build's time already spent: NNCF stops at its first
    check, the INT8 IR ships with nothing reverted, and the record says the time box stopped it."""
    from optimize import deadline

    deadline.set_window(0.0)
    try:
        built = _build(embedder, _ctx(tmp_path), min_cosine=0.9995, ranking_subset_size=8)
    finally:
        deadline.clear()
    control = built.record["accuracy_control"]
    assert control["reverted"] == 0 and built.precision == "int8"
    assert control["stopped"].startswith("stopped at its time box")
    assert not control["reached"]  # the score is measured, not the one the time box answered NNCF


def test_the_time_box_answers_nncf_s_check_and_stops_its_ranking():
    from optimize import deadline
    from optimize.compile import openvino_mixed

    calls = []
    stopped: dict = {}
    validate = openvino_mixed._time_boxed(lambda compiled, items: calls.append(items) or (0.5, [0.5]), 4, stopped)
    assert validate(None, iter(range(4))) == (0.5, [0.5]) and stopped == {}  # no deadline: NNCF's own score
    deadline.set_window(0.0)
    try:
        assert validate(None, iter(range(4))) == (1.0, [1.0] * 4) and stopped["where"] == "after a revert"
        with pytest.raises(openvino_mixed._TimeBoxed):
            validate(None, iter(range(2)))  # ranking on a subset: nothing to keep, the search ends
    finally:
        deadline.clear()
    assert len(calls) == 1 and stopped["where"] == "while ranking layers"
    assert "none reverted" in openvino_mixed._stopped_words(stopped)
