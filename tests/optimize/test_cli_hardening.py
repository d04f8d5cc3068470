"""The entry point under hostile command lines: unknown flags, overrides after a flag, and a bug
at plan time (exit 3, never Python's 1, which reads as a failed gate)."""

import subprocess
import sys

import pytest

from tests.support.cli import ROOT, one_error_line, refusal_in_process, run_optimize


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["recipe=minilm_int8_cpu", "--cfg", "job", "evaluate.warmup=1"], "overrides go before"),
        (["--bogus"], "--bogus"),
        (["--cfg", "nothing"], "nothing"),
    ],
)
def test_bad_flags_are_one_line(argv, fragment, tmp_path):
    one_error_line(run_optimize(*argv, f"hydra.run.dir={tmp_path}"), fragment)


def test_overrides_before_cfg_still_print_the_recipe(tmp_path):
    proc = run_optimize("recipe=minilm_int8_cpu", "evaluate.warmup=1", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "warmup: 1" in proc.stdout


def test_an_unexpected_error_at_plan_time_is_exit_3(tmp_path):
    # A bug inside the plan (any exception bad_input_message does not recognise): injected by
    # replacing the planner, since no input reaches one on purpose.
    code = (
        "import sys; from optimize import pipeline, __main__ as m\n"
        "def broken(cfg, run_dir): raise ZeroDivisionError('a bug')\n"
        "pipeline.plan = broken\n"
        f"sys.argv = ['optimize', 'hydra.run.dir={tmp_path}']\n"
        "m.main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "internal error" in proc.stderr and "ZeroDivisionError" in proc.stderr


def test_a_missing_optional_package_is_found_at_plan_time_in_one_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("compressed_tensors") is not None:
        pytest.skip("compressed-tensors is installed here")
    out = tmp_path / "out"
    proc = refusal_in_process("recipe=smollm2_int8_vllm", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}")
    one_error_line(proc, "quantize.method=ct_int8_w8a8 needs the compressed_tensors package", "pip install")
    assert not out.exists() and "Loading" not in proc.stderr  # refused before any weights load


def test_every_method_names_what_it_requires_and_a_missing_one_is_refused():
    from optimize import registry

    method = registry.get("engine", "compressed_tensors_checkpoint")
    assert [module for module, _ in method.requires] == ["compressed_tensors"]
    absent = registry.Method("quantize", "needs_nothing_real", object, print, requires=(("no_such_pkg_q", "pip x"),))
    assert absent.missing_package() == (
        "quantize.method=needs_nothing_real needs the no_such_pkg_q package, which is not installed: pip x"
    )
    assert registry.Method("quantize", "plain", object, print).missing_package() is None
