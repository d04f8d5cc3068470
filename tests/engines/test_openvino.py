"""OpenVINO engine on a tiny encoder-like ONNX graph built in-process (embedding -> Linear -> ReLU ->
LayerNorm -> Linear -> mean): real OpenVINO and NNCF, seconds on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install openvino nncf)")
onnx = pytest.importorskip("onnx")

from engines import load, load_engine  # noqa: E402
from engines.artifact import EngineUnavailable  # noqa: E402
from engines.onnxruntime.runner import OrtRunner  # noqa: E402
from engines.openvino import runner as openvino_runner  # noqa: E402
from engines.openvino.build import count_ops, onnx_to_ir  # noqa: E402
from engines.openvino.runner import OpenVINORunner, load_openvino_runner  # noqa: E402

VOCAB, WIDTH = 64, 64
WEIGHT_PARAMS = VOCAB * WIDTH + 2 * WIDTH * WIDTH  # embedding + two MatMul weights


def _tiny_encoder(path: Path, seed: int = 0) -> Path:
    """input_ids[batch, sequence] -> last_hidden_state[batch, sequence, 64], sentence_embedding[batch, 64]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [
        init("embedding", VOCAB, WIDTH),
        init("w1", WIDTH, WIDTH, scale=0.15),
        init("b1", WIDTH, scale=0.1),
        init("ln_scale", WIDTH, scale=0.1),
        init("ln_bias", WIDTH, scale=0.1),
        init("w2", WIDTH, WIDTH, scale=0.15),
        numpy_helper.from_array(np.array([1], np.int64), "sequence_axis"),
    ]
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["embedded"], name="embed"),
        helper.make_node("MatMul", ["embedded", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu1"),
        helper.make_node("LayerNormalization", ["h2", "ln_scale", "ln_bias"], ["h3"], name="norm", axis=-1),
        helper.make_node("MatMul", ["h3", "w2"], ["last_hidden_state"], name="fc2"),
        helper.make_node(
            "ReduceMean", ["last_hidden_state", "sequence_axis"], ["sentence_embedding"], name="pool", keepdims=0
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [
            helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", WIDTH]),
            helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", WIDTH]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _token_batches(count: int, batch: int = 4, sequence: int = 9, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, VOCAB, (batch, sequence))} for _ in range(count)]


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny ONNX model and its FP32 IR."""
    root = tmp_path_factory.mktemp("tiny_ov")
    onnx_path = _tiny_encoder(root / "model.onnx")
    return {"onnx": onnx_path, "xml": onnx_to_ir(onnx_path, root / "ir")}


@pytest.fixture(scope="module")
def int8_xml(tiny, tmp_path_factory):
    from engines.openvino.build import nncf_int8

    return nncf_int8(tiny["xml"], _token_batches(16), tmp_path_factory.mktemp("int8"), subset_size=16)


def _quantized_inputs(op) -> bool:
    """Whether an op reads an input through a FakeQuantize or from int8/uint8 weights (a few
    Convert/Multiply/Subtract steps up: NNCF stores INT8 weights as i8 constants dequantized on load)."""
    stack = [(i.get_source_output().get_node(), 0) for i in op.inputs()]
    while stack:
        node, depth = stack.pop()
        kind = node.get_type_name()
        if kind == "FakeQuantize":
            return True
        if kind == "Constant" and node.get_element_type().get_type_name() in ("i8", "u8"):
            return True
        if kind in ("Convert", "Multiply", "Subtract", "Reshape") and depth < 3:
            stack += [(i.get_source_output().get_node(), depth + 1) for i in node.inputs()]
    return False


def _matmuls(xml: Path) -> dict:
    return {
        op.get_friendly_name(): op for op in ov.Core().read_model(str(xml)).get_ops() if op.get_type_name() == "MatMul"
    }


@pytest.mark.parametrize("batch,sequence", [(1, 5), (5, 17)])
def test_fp32_ir_matches_onnxruntime_at_any_batch_and_length(tiny, batch, sequence):
    inputs = _token_batches(1, batch, sequence)[0]
    expected = OrtRunner(tiny["onnx"])(inputs)
    got = OpenVINORunner(tiny["xml"], threads=1)(inputs)
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].shape == expected[name].shape
        assert np.abs(got[name] - expected[name]).max() < 1e-4, name


def test_names_and_signature_spelled_like_onnxruntime(tiny):
    ort, ovr = OrtRunner(tiny["onnx"]), OpenVINORunner(tiny["xml"])
    assert ovr.input_names == ort.input_names == ["input_ids"]
    assert ovr.output_names == ort.output_names == ["last_hidden_state", "sentence_embedding"]
    (spec,) = ovr.signature()
    assert spec["name"] == "input_ids" and spec["type"] == "tensor(int64)" == ort.signature()[0]["type"]
    assert all(isinstance(d, str) for d in spec["shape"]) and len(spec["shape"]) == 2  # dynamic dims


def test_inputs_cast_to_declared_type(tiny):
    runner = OpenVINORunner(tiny["xml"])
    inputs = _token_batches(1, 2, 6)[0]
    as_int32 = runner({"input_ids": inputs["input_ids"].astype(np.int32)})
    np.testing.assert_array_equal(as_int32["sentence_embedding"], runner(inputs)["sentence_embedding"])
    with pytest.raises(KeyError, match="input_ids"):
        runner({"ids": inputs["input_ids"]})


def test_outputs_are_not_overwritten_by_the_next_call(tiny):
    runner = OpenVINORunner(tiny["xml"])
    first_inputs, second_inputs = _token_batches(2, 3, 7)
    first = runner(first_inputs)
    kept = {k: v.copy() for k, v in first.items()}
    runner(second_inputs)
    for name in kept:
        np.testing.assert_array_equal(first[name], kept[name])


def test_ir_keeps_fp32_weights(tiny):
    bin_bytes = tiny["xml"].with_suffix(".bin").stat().st_size
    assert bin_bytes >= 4 * WEIGHT_PARAMS  # FP16 compression would halve it
    constant_types = {
        op.get_element_type().get_type_name()
        for op in ov.Core().read_model(str(tiny["xml"])).get_ops()
        if op.get_type_name() == "Constant"
    }
    assert "f16" not in constant_types


def test_fp32_is_set_explicitly(tiny):
    """The CPU plugin's default precision is bf16 on CPUs with bf16; an FP32 artifact must run in f32."""
    runner = OpenVINORunner(tiny["xml"])
    assert runner.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"


def test_nncf_int8_quantizes_and_stays_close(tiny, int8_xml):
    ops = count_ops(int8_xml)
    assert ops.get("FakeQuantize", 0) >= 2, ops  # one per MatMul activation
    assert all(_quantized_inputs(op) for op in _matmuls(int8_xml).values())
    inputs = _token_batches(1, 8, 12, seed=7)[0]
    reference = OpenVINORunner(tiny["xml"])(inputs)["sentence_embedding"]
    quantized = OpenVINORunner(int8_xml)(inputs)["sentence_embedding"]
    assert _min_cosine(quantized, reference) > 0.98


def test_ignored_scope_leaves_the_named_node_in_fp32(tiny, tmp_path):
    from engines.openvino.build import nncf_int8

    xml = nncf_int8(tiny["xml"], _token_batches(8), tmp_path, subset_size=8, ignored_scope={"names": ["fc1"]})
    matmuls = _matmuls(xml)
    assert not _quantized_inputs(matmuls["fc1"])
    # fc2 writes a graph output, so OpenVINO names its node after that tensor
    assert _quantized_inputs(matmuls["last_hidden_state"])


def test_ignored_scope_rejects_unknown_keys(tiny, tmp_path):
    from engines.openvino.build import nncf_int8

    with pytest.raises(ValueError, match="nodes"):
        nncf_int8(tiny["xml"], _token_batches(2), tmp_path, subset_size=2, ignored_scope={"nodes": ["fc1"]})


@pytest.mark.slow
def test_accuracy_control_keeps_the_metric_within_max_drop(tiny, tmp_path):
    from engines.openvino.build import nncf_int8_with_accuracy_control

    reference = OpenVINORunner(tiny["xml"])

    def mean_cosine(compiled, batches) -> float:
        scores = [_min_cosine(compiled(b)[compiled.output(1)], reference(b)["sentence_embedding"]) for b in batches]
        return float(np.mean(scores))

    validation = _token_batches(4, seed=3)
    xml = nncf_int8_with_accuracy_control(
        tiny["xml"], _token_batches(8), validation, mean_cosine, 0.01, tmp_path, subset_size=8
    )
    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert mean_cosine(compiled, validation) >= 1.0 - 0.01 - 1e-6


def _write_artifact(root: Path, xml: Path, engine: dict) -> Path:
    root.mkdir()
    for suffix in (".xml", ".bin"):
        (root / f"model{suffix}").write_bytes(xml.with_suffix(suffix).read_bytes())
    from engines.artifact import SCHEMA_VERSION, file_table, seal

    manifest = seal({"schema_version": SCHEMA_VERSION, "engine": engine, "files": file_table(root)})
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_load_from_a_manifest_engine_block(tiny, tmp_path):
    engine = {"format": "openvino", "file": "model.xml", "inference_precision": "f32", "performance_hint": "LATENCY"}
    root = _write_artifact(tmp_path / "artifact", tiny["xml"], engine)
    runner = load(root, threads=1, spinning=False)
    assert isinstance(runner, OpenVINORunner)
    assert runner.properties == {
        "INFERENCE_PRECISION_HINT": "f32",
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_NUM_THREADS": 1,
        "ENABLE_CPU_PINNING": False,
    }
    inputs = _token_batches(1, 2, 4)[0]
    np.testing.assert_allclose(
        runner(inputs)["sentence_embedding"], OrtRunner(tiny["onnx"])(inputs)["sentence_embedding"], atol=1e-4
    )


def test_bf16_artifact_refused_on_a_cpu_without_bf16(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(openvino_runner, "cpu_optimization_capabilities", lambda: ["FP32", "INT8", "BIN"])
    engine = {"format": "openvino", "file": "model.xml", "inference_precision": "bf16"}
    root = _write_artifact(tmp_path / "artifact", tiny["xml"], engine)
    with pytest.raises(EngineUnavailable, match="bf16") as caught:
        load_engine(root, engine)
    message = str(caught.value)
    assert "\n" not in message and "avx512_bf16" in message and "model.xml" in message


def test_bf16_artifact_runs_where_the_cpu_has_it(tiny, tmp_path):
    if not openvino_runner.bf16_supported():
        pytest.skip("this CPU has no native bf16 (OpenVINO lists no BF16 capability)")
    engine = {"format": "openvino", "file": "model.xml", "inference_precision": "bf16"}
    runner = load_openvino_runner(_write_artifact(tmp_path / "artifact", tiny["xml"], engine), engine)
    inputs = _token_batches(1, 2, 4)[0]
    reference = OrtRunner(tiny["onnx"])(inputs)["sentence_embedding"]
    assert _min_cosine(runner(inputs)["sentence_embedding"], reference) > 0.99


def test_unknown_precision_or_hint_is_a_value_error(tiny):
    with pytest.raises(ValueError, match="inference_precision"):
        OpenVINORunner(tiny["xml"], inference_precision="int4")
    with pytest.raises(ValueError, match="performance_hint"):
        OpenVINORunner(tiny["xml"], performance_hint="FAST")
