"""An ONNX file from elsewhere that cannot go through as asked: one line, exit 2, nothing written.
The model is PP-OCRv4's text detector (rapidocr-onnxruntime): x [N, 3, H, W], H and W dynamic and
multiples of 32, every weight in a convolution."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.support.cli import one_error_line, run_optimize

pytest.importorskip("rapidocr_onnxruntime")

DETECTOR = (
    "model.source=pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
    "model.task=generic",
    "engine=onnx",
    "gate=none",
    "gate.min_cosine=0.98",
    "evaluate.data.count=4",
    "evaluate.batch_sizes=[1]",
    "evaluate.latency=false",
    "evaluate.memory=false",
)


def refuse(tmp_path, *overrides: str, fragments=()) -> str:
    proc = run_optimize(*overrides, f"hydra.run.dir={tmp_path / 'run'}", f"output_dir={tmp_path / 'out'}", timeout=300)
    line = one_error_line(proc, *fragments)
    assert "this is a bug" not in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()
    return line


def test_text_calibration_for_a_tensor_model_names_the_source(tmp_path):
    # The first command: the sensitivity fallback used to ask for a tokenizer.
    refuse(
        tmp_path,
        *DETECTOR,
        "evaluate.inputs=random",
        "quantize=ort_int8_dynamic",
        fragments=["calibration.source=cpython_docs gives text", "x[N,3,?,?] float32", "image_folder"],
    )


def test_text_evaluation_data_for_a_tensor_model_names_the_source(tmp_path):
    refuse(tmp_path, *DETECTOR, fragments=["evaluate.data.source=cpython_docs gives text", "evaluate.inputs=random"])


RANDOM_DYNAMIC = ("evaluate.inputs=random", "calibration=random", "quantize=ort_int8_dynamic")


def test_symbolic_spatial_dims_are_never_guessed_and_the_advice_runs_as_written(tmp_path):
    # The second command: every symbolic dim used to become 16.
    line = refuse(
        tmp_path / "a",
        *DETECTOR,
        *RANDOM_DYNAMIC,
        fragments=[
            "model input 'x' dim 2 is symbolic (p2o.DynamicDimension.1)",
            "add '++model.inputs.x.shape=[N,3,64,64]' with your sizes in place of 64",
        ],
    )
    # Copied from the line as a shell reads it, the override gets the run past that refusal, on to the
    # method's own (op types that match none of the graph's weighted nodes).
    (quoted,) = re.findall(r"add ('[^']*')", line)
    refuse(
        tmp_path / "b",
        *DETECTOR,
        *RANDOM_DYNAMIC,
        *shlex.split(quoted),
        "quantize.params.op_types=[MatMul,Gemm]",
        fragments=["cannot apply"],
    )


@pytest.mark.parametrize(
    "shape, fragment",
    [
        ("[N,3,-4,64]", "model.inputs.x.shape dim 2 is -4: a dim is a positive whole number"),
        ("[N,3,8.5,64]", "model.inputs.x.shape dim 2 is 8.5: a dim is a positive whole number"),
        ("[N,3,99999999999999999999999,64]", "model input 'x' dim 2 is beyond int64"),
        ("[N,3,100000,100000]", "model input 'x' dim 3 is 100000"),
    ],
)
def test_absurd_dims_are_bad_input(tmp_path, shape, fragment):
    # These were exit 3, an internal error: numpy's ValueError or MemoryError; 8.5 ran as 8.
    line = refuse(tmp_path, *DETECTOR, *RANDOM_DYNAMIC, f"++model.inputs.x.shape={shape}", fragments=[fragment])
    assert "internal error" not in line


def test_a_model_that_cannot_run_on_the_shapes_is_bad_input(tmp_path):
    line = refuse(
        tmp_path,
        *DETECTOR,
        "evaluate.inputs=random",
        "calibration=random",
        "quantize=ort_int8_dynamic",
        "+model.inputs.x.shape=[N,3,50,50]",
        fragments=["the model fails on the inputs x[1, 3, 50, 50] float32", "broadcast"],
    )
    assert "internal error" not in line


def test_a_method_with_nothing_to_quantize_says_so(tmp_path):
    refuse(
        tmp_path,
        *DETECTOR,
        "evaluate.inputs=random",
        "calibration=random",
        "quantize=ort_int8_dynamic",
        "quantize.params.fallback_min_cosine=null",
        "quantize.params.op_types=[MatMul,Gemm]",  # the default is the graph's own: Conv
        "+model.inputs.x.shape=[N,3,64,64]",
        fragments=["quantize.method=ort_int8_dynamic cannot apply", "MatMul, Gemm", "62 Conv", "op_types"],
    )


def test_image_data_of_the_wrong_size_for_the_model(tmp_path):
    refuse(
        tmp_path,
        "recipe=ppocr_det_int8_static",
        "calibration.image.size=[50,50]",
        "evaluate.data.image.size=[50,50]",
        "calibration.count=2",
        "quantize.params.calibration_count=2",
        "evaluate.latency=false",
        "evaluate.memory=false",
        fragments=["the model fails on the inputs x[1, 3, 50, 50]"],
    )


def test_unknown_input_names_and_mask_outputs(tmp_path):
    refuse(
        tmp_path / "a",
        "recipe=ppocr_det_int8_static",
        "+model.inputs.image.shape=[1,3,64,64]",
        fragments=["['image']", "it takes ['x']"],
    )
