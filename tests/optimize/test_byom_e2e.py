"""Bring your own model, end to end: ONNX files this project does not train, calibrated on real data
of their kind, quantized to INT8 (dynamic and static), gated, and served over KServe v2 through
tritonclient on loopback, with declared shapes and dtypes checked (422 otherwise).

- PP-OCRv4's text detector (rapidocr-onnxruntime): dynamic H and W, images from scikit-image's wheel.
- Silero VAD (silero-vad): a 512-sample audio window plus an LSTM state [2, N, 128] and a scalar
  sample rate; WAV files written at 44.1 kHz and resampled by the source (tests/support/audio.py).

Small on purpose: 64x64 tiles, a few calibration items, no latency or memory runs. The detector is
calibrated and evaluated on tiles of scikit-image's two pictures of printed text (held out by
content hash, as every image source splits), so the masks it is gated on hold text: its held-out
photos have almost none at any size, and IoU over empty masks measures nothing.

Verdicts and CPUs: ONNX Runtime's integer kernels differ by CPU. Without VNNI (AVX2 only) the
quantize methods keep weights to 7 bits (`reduce_range`), with VNNI they use all 8. Measured on the
text tiles with both settings: static INT8 pooled mask IoU 0.856 (7-bit) and 0.869 (8-bit), so its
verdict at 0.75 holds on every CPU kind; dynamic INT8 (ConvInteger) 0.72 and 0.91, so its verdict
depends on the CPU and its test asserts that it was gated, not how.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.audio import write_wavs
from tests.support.cli import run_optimize
from tests.support.serve import running_server

pytest.importorskip("rapidocr_onnxruntime")
pytest.importorskip("silero_vad")
pytest.importorskip("skimage")

FAST = ["evaluate.latency=false", "evaluate.memory=false", "evaluate.batch_sizes=[1]"]
TEXT_TILES = ["files=*.png", "tile=true", "size=[64,64]"]  # 16 calibration and 10 evaluation tiles
SMALL_IMAGES = [
    "calibration.count=8",
    *(f"calibration.image.{option}" for option in TEXT_TILES),
    *(f"evaluate.data.image.{option}" for option in TEXT_TILES),
    "evaluate.data.count=10",
    "model.inputs.x.shape=[N,3,64,64]",
]


def optimize(tmp_path, name: str, *overrides: str, verdict: str | None = "passed") -> dict:
    """One run; `verdict=None` takes either verdict, as long as the exit code says the same."""
    out = tmp_path / name
    proc = run_optimize(*overrides, *FAST, f"output_dir={out}", f"hydra.run.dir={tmp_path / ('run-' + name)}")
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verdict"] == ("passed" if proc.returncode == 0 else "failed"), proc.stdout[-3000:]
    assert verdict in (None, manifest["verdict"]), proc.stdout[-3000:]
    return manifest


def text_pictures(folder):
    """scikit-image's two pictures of printed text (a scanned page and a line of text), copied."""
    import shutil

    import skimage

    folder.mkdir()
    data = Path(skimage.__file__).parent / "data"
    for name in ("page.png", "text.png"):
        shutil.copy(data / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def detector_artifacts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppocr")
    images = [f"calibration.path={text_pictures(tmp / 'text')}", *SMALL_IMAGES]
    dynamic = optimize(
        tmp, "dynamic", "recipe=ppocr_det_int8_dynamic", *images, "quantize.params.sensitivity_samples=4", verdict=None
    )
    static = optimize(
        tmp,
        "static",
        "recipe=ppocr_det_int8_static",
        *images,
        "quantize.params.calibration_count=8",
        "gate.min_mask_iou=0.75",  # measured 0.856 with 7-bit weights, 0.869 with 8-bit (module docstring)
    )
    return tmp, dynamic, static


def test_detector_int8_dynamic_and_static_are_gated_on_the_text_masks(detector_artifacts):
    _, dynamic, static = detector_artifacts
    for manifest, kernel in ((dynamic, "ConvInteger"), (static, "Conv")):
        assert manifest["calibration"]["source"] == "image_folder" and manifest["calibration"]["count"] == 8
        assert manifest["calibration"]["image"]["size"] == [64, 64] and "random" not in manifest["calibration"]
        assert manifest["evaluation"]["source"] == "image_folder" and manifest["evaluation"]["split"] == "evaluation"
        assert manifest["evaluation"]["count"] == 10 and manifest["calibration"]["image"]["tile"] is True
        assert manifest["stages"]["quantize"]["kernels"]["by_op"].get(kernel, 0) > 0
        mask = manifest["metrics"]["candidate"]["fidelity"]["mask"]
        assert mask["output"] == "sigmoid_0.tmp_0" and mask["positive_pixels"] > 1000  # the tiles hold text
        assert 0 <= mask["iou"] <= 1 and mask["pixel_agreement"] > 0.9
        checks = {c["name"]: c for c in manifest["gate"]["checks"]}
        assert {"min_mask_iou", "min_mask_agreement"} <= set(checks)
        assert checks["min_mask_iou"]["value"] == pytest.approx(mask["iou"])
        # The weight range follows the CPU the environment block names (7 bits without VNNI).
        vnni = {"avx512_vnni", "avx_vnni", "amx_int8"} & set(manifest["environment"]["cpu"]["features"])
        assert manifest["stages"]["quantize"]["reduce_range"] is not bool(vnni)
        # The signature keeps the graph's symbolic H and W: serve takes any size.
        assert manifest["engine"]["inputs"][0]["name"] == "x" and isinstance(
            manifest["engine"]["inputs"][0]["shape"][2], str
        )
    assert static["verdict"] == "passed"  # on every CPU kind (module docstring)
    assert static["stages"]["quantize"]["kernels"]["int8"] == 62  # every convolution


def test_detector_served_over_kserve_v2(detector_artifacts):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    tmp, _, manifest = detector_artifacts
    name = manifest["recipe"]["name"]
    with running_server(tmp / "static") as server:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        meta = client.get_model_metadata(name)
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1, -1]}]
        image = np.random.default_rng(0).uniform(-1, 1, (2, 3, 64, 96)).astype(np.float32)
        for binary in (True, False):
            tensor = triton.InferInput("x", list(image.shape), "FP32")
            tensor.set_data_from_numpy(image, binary_data=binary)
            result = client.infer(name, [tensor])
            maps = result.as_numpy("sigmoid_0.tmp_0")
            assert maps.shape == (2, 1, 64, 96) and 0 <= maps.min() and maps.max() <= 1
        with pytest.raises(InferenceServerException, match="must be FP32"):
            bad = triton.InferInput("x", [1, 3, 64, 64], "FP64")
            bad.set_data_from_numpy(np.zeros((1, 3, 64, 64)))
            client.infer(name, [bad])
        with pytest.raises(InferenceServerException, match=r"takes \[-1, 3, -1, -1\]"):
            bad = triton.InferInput("x", [1, 4, 64, 64], "FP32")
            bad.set_data_from_numpy(np.zeros((1, 4, 64, 64), np.float32))
            client.infer(name, [bad])
        with pytest.raises(InferenceServerException, match="cannot run on"):  # H not a multiple of 32
            bad = triton.InferInput("x", [1, 3, 50, 50], "FP32")
            bad.set_data_from_numpy(np.zeros((1, 3, 50, 50), np.float32))
            client.infer(name, [bad])


@pytest.fixture(scope="module")
def vad_artifacts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("silero")
    write_wavs(tmp / "wavs", 12, seconds=1.0)
    audio = [f"calibration.path={tmp / 'wavs'}", "calibration.count=32", "evaluate.data.count=16"]
    static = optimize(tmp, "static", "recipe=silero_vad_int8_static", *audio, "quantize.params.calibration_count=32")
    dynamic = optimize(
        tmp, "dynamic", "recipe=silero_vad_int8_dynamic", *audio, "quantize.params.sensitivity_samples=4"
    )
    return tmp, static, dynamic


def test_vad_int8_on_resampled_audio_passes_its_gate(vad_artifacts):
    _, static, dynamic = vad_artifacts
    for manifest in (static, dynamic):
        assert manifest["verdict"] == "passed"
        assert manifest["calibration"]["audio"] == {"sample_rate": 16000, "samples": 512, "hop": 512}
        fidelity = manifest["metrics"]["candidate"]["fidelity"]
        assert set(fidelity["outputs"]) == {"output"} and fidelity["max_abs_error"] <= 0.1
    assert static["stages"]["quantize"]["kernels"]["int8"] == 6
    # The sensitivity fallback ran on the audio windows (not on text) and kept what it ranked worst.
    fallback = dynamic["stages"]["quantize"]
    assert isinstance(fallback["calibration_min_cosine"], float) and fallback["kernels"]["int8"] >= 1
    assert static["stages"]["inputs"] == {
        "data_input": "input",
        "resolved": {
            "input": {"dims": ["N", 512], "dtype": "float32", "value": None},
            "state": {"dims": [2, "N", 128], "dtype": "float32", "value": 0.0},
            "sr": {"dims": [], "dtype": "int64", "value": 16000},
        },
    }


def test_vad_served_over_kserve_v2_with_its_state_and_rate(vad_artifacts):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    tmp, manifest, _ = vad_artifacts
    name = manifest["recipe"]["name"]
    arrays = {
        "input": np.random.default_rng(1).uniform(-0.5, 0.5, (3, 512)).astype(np.float32),
        "state": np.zeros((2, 3, 128), np.float32),
        "sr": np.array(16000, dtype=np.int64),
    }
    datatypes = {"input": "FP32", "state": "FP32", "sr": "INT64"}
    with running_server(tmp / "static") as server:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        inputs = []
        for key, array in arrays.items():
            tensor = triton.InferInput(key, list(array.shape), datatypes[key])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer(name, inputs)
        assert result.as_numpy("output").shape == (3, 1) and result.as_numpy("stateN").shape == (2, 3, 128)
        with pytest.raises(InferenceServerException, match="must be INT64"):
            bad = triton.InferInput("sr", [], "INT32")
            bad.set_data_from_numpy(np.array(16000, dtype=np.int32))
            client.infer(name, inputs[:2] + [bad])
        with pytest.raises(InferenceServerException, match="missing"):
            client.infer(name, inputs[:2])


def test_the_issues_command_runs_once_the_shapes_are_given(tmp_path):
    """The issue's first command (random evaluation, the sensitivity fallback on) with the one
    override its refusal asks for, and Conv among the op types: a gated artifact on random tensors."""
    manifest = optimize(
        tmp_path,
        "random",
        "model.source=pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "model.task=generic",
        "engine=onnx",
        "evaluate.inputs=random",
        "calibration=random",
        "calibration.count=2",
        "evaluate.data.count=2",
        "quantize=ort_int8_dynamic",
        "quantize.params.op_types=[Conv]",
        "quantize.params.sensitivity_samples=2",
        "quantize.params.max_fp32_nodes=1",
        "+model.inputs.x.shape=[N,3,32,64]",
        "+model.inputs.x.low=-1",
        "+model.inputs.x.high=1",
        "gate=none",
        "gate.max_size_mb=4",  # 4.5 MB in FP32: passes only if the convolutions really are INT8
    )
    assert manifest["calibration"]["random"] is True and manifest["evaluation"]["source"] == "random"
    assert manifest["stages"]["inputs"]["resolved"]["x"]["dims"] == ["N", 3, 32, 64]
    assert len(manifest["stages"]["quantize"]["fp32_nodes"]) <= 1
