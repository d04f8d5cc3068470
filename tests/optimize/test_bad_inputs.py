"""Bad inputs are exit 2 with one line naming them, never a traceback (findings 5, 6, 7, 10, 13, 14, 15),
and a fuzz run over random overrides shows only refusals or plans, never a bug."""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optimize import artifact
from optimize.errors import RecipeError, bad_input_message
from tests.support.cli import FAST_OVERRIDES, ROOT, one_error_line, refusal_in_process, run_optimize

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402


def onnx_model(domain: str = "", external: str | None = None):
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4], [1.0] * 4)
    node = helper.make_node("Add" if not domain else "Frobnicate", ["x", "w"], ["y"], domain=domain)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
        [weight],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    if external is not None:
        w = model.graph.initializer[0]
        w.ClearField("float_data")
        w.data_location = TensorProto.EXTERNAL
        for key, value in (("location", external), ("offset", "0"), ("length", "16")):
            entry = w.external_data.add()
            entry.key, entry.value = key, value
    return model


def refuse(tmp_path: Path, *overrides: str, fragments=(), log_lines: bool = False, at_plan: bool = True) -> str:
    """The refusal of a run with these overrides. `at_plan`: one the command's check makes before it runs
    anything, run in this process (refusal_in_process); else one the run makes, by the real command."""
    command = refusal_in_process if at_plan else functools.partial(run_optimize, timeout=300)
    proc = command(*overrides, f"hydra.run.dir={tmp_path / 'run'}", f"output_dir={tmp_path / 'out'}")
    line = one_error_line(proc, *fragments, log_lines=log_lines)
    assert "this is a bug" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "run").exists(), "a refused run must not leave Hydra's .hydra/ and log"
    return line


GENERIC = ("model.task=generic", "evaluate.inputs=random", "gate=none", "gate.min_cosine=0.9")


# --- finding 5: every bad ONNX source --------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "corrupt",
        "truncated",
        "empty",
        "custom_domain",
        "external_outside",
        "external_missing",
        "directory",
        "fifo",
        "symlink",
    ],
)
def test_bad_onnx_sources_exit_2(tmp_path, case):
    source = tmp_path / "model.onnx"
    good = onnx_model().SerializeToString()
    if case == "corrupt":
        source.write_bytes(b"\x08\x07garbage" * 50)
    elif case == "truncated":
        source.write_bytes(good[: len(good) // 2])
    elif case == "empty":
        source.write_bytes(b"")
    elif case == "custom_domain":
        source.write_bytes(onnx_model(domain="com.example.custom").SerializeToString())
    elif case == "external_outside":
        (tmp_path.parent / "secret.bin").write_bytes(b"\0" * 16)
        source.write_bytes(onnx_model(external="../secret.bin").SerializeToString())
    elif case == "external_missing":
        source.write_bytes(onnx_model(external="weights.bin").SerializeToString())
    elif case == "directory":
        source.mkdir()
    elif case == "fifo":
        os.mkfifo(source)
    elif case == "symlink":
        (tmp_path / "real.onnx").write_bytes(good)
        source.symlink_to(tmp_path / "real.onnx")
    refuse(tmp_path, f"model.source={source}", *GENERIC, fragments=[str(source)])


def test_onnx_with_external_data_beside_it_runs_and_hashes_its_data(tmp_path):
    """Finding 6: the data file travels into the artifact, is hashed as part of the source, verifies."""
    import numpy as np

    from engines.artifact import read_manifest

    source = tmp_path / "src" / "model.onnx"
    source.parent.mkdir()
    (source.parent / "weights.bin").write_bytes(np.ones(4, np.float32).tobytes())
    source.write_bytes(onnx_model(external="weights.bin").SerializeToString())
    out = tmp_path / "out"
    proc = run_optimize(
        f"model.source={source}",
        *GENERIC,
        "quantize=none",
        "evaluate.data.count=8",
        "evaluate.batch_sizes=[2]",
        "evaluate.repeats=3",
        "evaluate.memory=false",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = read_manifest(out)
    assert set(manifest["model"]["sha256"]) == {"model.onnx", "weights.bin"}
    assert "weights.bin" in {f["path"] for f in manifest["files"]}
    assert manifest["metrics"]["candidate"]["fidelity"]["max_abs_error"] == 0.0
    verify = subprocess.run([sys.executable, "-m", "optimize.verify", str(out)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_custom_code_model_exits_2(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "totally_custom",
                "architectures": ["CustomModel"],
                "auto_map": {
                    "AutoConfig": "configuration_custom.CustomConfig",
                    "AutoModel": "modeling_custom.CustomModel",
                },
            }
        )
    )
    (folder / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    (folder / "model.safetensors").write_bytes(b"")
    refuse(
        tmp_path,
        f"model.source={folder}",
        *FAST_OVERRIDES,
        fragments=["trust_remote_code"],
        log_lines=True,
        at_plan=False,
    )


@pytest.mark.parametrize(
    "value, fragment, at_plan",
    [("0", "model.max_length=0", True), ("-3", "model.max_length=-3", True), ("100000", "512 positions", False)],
)
def test_max_length_outside_the_position_embeddings_exits_2(tmp_path, value, fragment, at_plan):
    refuse(
        tmp_path, f"model.max_length={value}", *FAST_OVERRIDES, fragments=[fragment], log_lines=True, at_plan=at_plan
    )


def test_unwritable_output_dir_exits_2(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = run_optimize(f"output_dir={tmp_path / 'afile' / 'sub'}", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "not a directory")
    proc = run_optimize(
        "output_dir=/proc/optimize-cannot-write-here", f"hydra.run.dir={tmp_path / 'run'}", *FAST_OVERRIDES, timeout=300
    )
    one_error_line(proc, "/proc/optimize-cannot-write-here", log_lines=True)


def test_library_errors_map_to_one_line():
    """The one place that recognises what libraries raise for a bad input."""
    from google.protobuf.message import DecodeError
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidGraph
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented

    assert "ONNX Runtime cannot load" in bad_input_message(InvalidGraph("bad graph"))
    assert "no kernel" in bad_input_message(OrtNotImplemented("Could not find an implementation for Foo"))
    assert "not a valid ONNX" in bad_input_message(DecodeError("Error parsing message"))
    assert "checker" in bad_input_message(onnx.checker.ValidationError("Field 'type' of 'value_info' is required"))
    assert "trust_remote_code" in bad_input_message(ValueError("... set the option `trust_remote_code=True` ..."))
    assert "pickle" in bad_input_message(pickle.UnpicklingError("Weights only load failed"))
    assert "cannot use /ro/x" in bad_input_message(PermissionError(13, "Permission denied", "/ro/x"))
    assert bad_input_message(RecipeError("x")) == "x"
    for bug in (KeyError("k"), TypeError("t"), ValueError("v"), ZeroDivisionError()):
        assert bad_input_message(bug) is None


# --- finding 7: `+key` cannot get around the schema --------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        "+gate.min_cosin=0.999",
        "++gate.min_cosin=0.999",
        "+quantize.params.bogus=1",
        "+model.sorce=x",
        "+evaluate.data.bogus=1",
    ],
)
def test_plus_key_outside_the_schema_exits_2(tmp_path, override):
    key = override.lstrip("+").split("=")[0]
    refuse(tmp_path, override, fragments=[key, "no such key"])


def test_plus_key_inside_a_free_form_section_is_accepted(tmp_path):
    proc = run_optimize("--cfg", "job", "+evaluate.task_params.my_option=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0 and "my_option: 3" in proc.stdout, proc.stderr


# --- finding 10: overwrite never replaces a plain file ---------------------------------------------


def test_overwrite_refuses_a_plain_file_or_link(tmp_path):
    target = tmp_path / "out"
    target.write_text("precious")
    proc = run_optimize(f"output_dir={target}", "overwrite=true", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "is a file")
    assert target.read_text() == "precious"
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(RecipeError, match="symbolic link"):
        artifact.check_destination(link, overwrite=True)


# --- finding 13: data files are capped ---------------------------------------------------------------


def test_data_files_are_capped_and_checked(tmp_path, monkeypatch):
    import calibration

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(2 << 20)  # sparse: 2 MiB that take no disk
    monkeypatch.setenv(calibration.MAX_DATA_BYTES_ENV, str(1 << 20))
    with pytest.raises(calibration.DataError, match="over the limit of 1048576"):
        calibration.load("text_file", "calibration", 1, 0, path=str(big))
    for path, fragment in (
        (tmp_path, "is a directory"),
        ("/dev/zero", "is a device"),
        (tmp_path / "nope.txt", "does not exist"),
    ):
        with pytest.raises(calibration.DataError, match=fragment):
            calibration.load("text_file", "calibration", 1, 0, path=str(path))
    os.mkfifo(tmp_path / "fifo.txt")
    with pytest.raises(calibration.DataError, match="FIFO"):
        calibration.load("jsonl", "calibration", 1, 0, path=str(tmp_path / "fifo.txt"))


def test_a_huge_data_file_is_refused_from_the_cli_without_reading_it(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
    started = time.monotonic()
    refuse(
        tmp_path,
        "calibration.source=text_file",
        f"calibration.path={big}",
        fragments=["over the limit", "OPTIMIZE_MAX_DATA_BYTES"],
        at_plan=False,
    )
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("path, fragment", [("DIR", "is a directory"), ("/dev/zero", "is a device")])
def test_data_path_kind_is_named(tmp_path, path, fragment):
    path = str(tmp_path) if path == "DIR" else path
    refuse(tmp_path, "calibration.source=text_file", f"calibration.path={path}", fragments=[fragment], at_plan=False)


# --- finding 14: crash hygiene ---------------------------------------------------------------------


def test_a_dead_runs_partial_directory_is_removed_by_the_next_run(tmp_path):
    final = tmp_path / "artifact"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".artifact.partial-{dead.pid}-deadbeef"
    (stale / "scratch").mkdir(parents=True)
    (stale / "scratch" / "big.bin").write_bytes(b"x" * 1000)
    alive = tmp_path / f".artifact.partial-{os.getpid()}-cafe0123"
    alive.mkdir()
    other = tmp_path / ".other.partial-1-00"
    other.mkdir()
    with artifact.staging(final) as stage:
        scratch = artifact.scratch_for(stage)
        assert scratch.parent == stage.parent and stage.parent.name.startswith(f".artifact.partial-{os.getpid()}-")
    assert not stale.exists() and alive.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


def test_sigkill_leaves_one_partial_directory_that_the_next_run_removes(tmp_path):
    out = tmp_path / "artifact"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "optimize",
            *FAST_OVERRIDES,
            "evaluate.memory=true",
            f"output_dir={out}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 180
    while time.time() < deadline and not list(tmp_path.glob(".artifact.partial-*/artifact/tokenizer")):
        time.sleep(0.2)
    partials = list(tmp_path.glob(".artifact.partial-*"))
    assert partials, "the run never started staging"
    assert (partials[0] / "scratch").is_dir(), "scratch lives inside the partial directory"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert [p.name for p in tmp_path.glob(".artifact*")] == [partials[0].name]
    proc = run_optimize(
        f"output_dir={out}",
        "calibration.source=text_file",
        f"calibration.path={tmp_path / 'no'}",
        f"hydra.run.dir={tmp_path / 'run2'}",
        *FAST_OVERRIDES[:1],
    )
    assert proc.returncode == 2  # refused at plan: staging never ran
    with artifact.staging(out):
        pass
    assert not list(tmp_path.glob(".artifact*"))


def test_memory_probe_dies_with_its_parent(tmp_path):
    """The probe child asks the kernel for SIGKILL when its parent dies."""
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'from engines.memprobe import die_with_parent; "
        "die_with_parent(); import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.0)
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":  # a zombie waiting for init to reap it: dead
                return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the probe outlived its parent")


# --- finding 15: network, exit codes ---------------------------------------------------------------


def test_hub_id_without_network_is_quick_and_one_line(tmp_path):
    started = time.monotonic()
    proc = run_optimize(
        "model.source=nobody-here/no-such-model",
        *FAST_OVERRIDES,
        f"hydra.run.dir={tmp_path / 'run'}",
        f"output_dir={tmp_path / 'out'}",
        env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")},
    )
    one_error_line(proc, "nobody-here/no-such-model", log_lines=True)
    assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr
    assert time.monotonic() - started < 25


def test_sigterm_exits_143_as_documented(tmp_path):
    import optimize.__main__ as cli

    assert "143 stopped by SIGTERM" in cli.__doc__ and "130 interrupted by SIGINT" in cli.__doc__
    out = tmp_path / "artifact"
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimize", *FAST_OVERRIDES, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".artifact.partial-*")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert not out.exists() and not list(tmp_path.glob(".artifact*"))
