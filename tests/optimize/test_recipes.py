"""Every recipe composes against the schema and passes the pre-flight check, so a renamed key or
a broken preset fails here, not in a user's hands. The GPU presets (`*_gpu`, `*_trt`) plan on a
machine that has what they need, and elsewhere refuse with the one line that names what is missing:
any other error, a typo included, fails."""

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from optimize import pipeline
from optimize.__main__ import CONFIG_DIR
from optimize.config import register_schema
from optimize.errors import RecipeError
from tests.support.cli import one_error_line, refusal_in_process

RECIPES = sorted(p.stem for p in (Path(CONFIG_DIR) / "recipe").glob("*.yaml"))
NEEDS_GPU = ("_gpu", "_trt")
GPU_RECIPES = [name for name in RECIPES if any(tag in name for tag in NEEDS_GPU)]


def expected_refusal(name: str) -> str | None:
    """The pre-flight refusal of GPU preset `name` on this machine; None where it has what the preset needs.
    The message is spelled out here, and each missing piece is checked to be named in it."""
    if name == "minilm_fp16_trt":
        import onnxruntime as ort

        from engines.onnxruntime.providers import missing_for

        missing = missing_for("TensorrtExecutionProvider")
        if not missing:
            return None
        message = "quantize.method=ort_fp16 targets TensorrtExecutionProvider, and this machine lacks " + "; ".join(
            missing
        )
        if importlib.util.find_spec("tensorrt") is None:
            assert "TensorRT (the tensorrt Python package)" in message
        if "TensorrtExecutionProvider" not in ort.get_available_providers():
            assert "install onnxruntime-gpu" in message
        return message
    if name == "smollm2_fp8_gpu":
        from optimize.quantize.modelopt import cuda_missing

        missing = cuda_missing()
        if missing:  # the quantize stage is checked first: its device=cuda is refused
            assert "CUDA is not available" in missing or "torch is not installed" in missing
            return f"quantize.params.device=cuda needs CUDA: {missing}"
        if importlib.util.find_spec("tensorrt") is None:
            return "engine.params.tensorrt=true needs CUDA and TensorRT: the tensorrt package is not installed"
        return None
    if name == "smollm2_bf16_gpu":
        from engines.pytorch.cuda_runner import cuda_missing

        missing = cuda_missing("bf16")
        return f"engine.method=torch_cuda needs {missing}" if missing else None
    raise AssertionError(f"{name} looks like a GPU preset: spell out its refusal in expected_refusal()")


def untrained_refusal(cfg) -> str | None:
    """A recipe whose model the project trains into the cache (minilm_cls_int8_cpu) plans once it
    is trained; before that it refuses with the one line that says how to train it."""
    from optimize.sources.models import TRAINED_IN_CACHE, cache_root

    path = Path(cfg.model.source)
    for name, command in TRAINED_IN_CACHE.items():
        if path == cache_root() / name and not path.exists():
            return (
                f"model.source={cfg.model.source}: no such file or directory (this model is trained on this "
                f"machine: run {command} first, a few minutes on 2 cores)"
            )
    return None


def package_refusal(cfg) -> str | None:
    """A recipe whose methods need an optional package this machine lacks (compressed-tensors for
    smollm2_int8_vllm) refuses at plan time with the line naming it and how to install it."""
    from optimize import registry

    for stage in registry.STAGES:
        if cfg[stage].method not in (None, "none"):
            missing = registry.get(stage, cfg[stage].method).missing_package()
            if missing:
                return missing
    return None


def compose_recipe(name: str, *overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose("config", overrides=[f"recipe={name}", *overrides])


def test_there_is_a_default_recipe():
    assert "minilm_int8_cpu" in RECIPES


# The causal-LM presets plan against their GGUF model (seconds each): they are slow tests.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "smollm2" in n else n for n in RECIPES])
def test_recipe_composes_and_plans(name, tmp_path):
    cfg = compose_recipe(name, f"output_dir={tmp_path / 'out'}")
    refusal = expected_refusal(name) if name in GPU_RECIPES else untrained_refusal(cfg) or package_refusal(cfg)
    if refusal is not None:
        with pytest.raises(RecipeError) as refused:
            pipeline.plan(cfg, tmp_path)
        assert str(refused.value) == refusal
        return
    plan = pipeline.plan(cfg, tmp_path)
    assert plan.final_dir == (tmp_path / "out").resolve()
    assert any(method.stage == "engine" for method, _ in plan.stages)


@pytest.mark.slow
@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_preset_refusal_is_one_line_on_the_command_line(name, tmp_path):
    refusal = expected_refusal(name)
    if refusal is None:
        pytest.skip(f"this machine has what {name} needs (test_recipe_composes_and_plans plans it)")
    out = tmp_path / "out"
    proc = refusal_in_process(f"recipe={name}", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}")
    assert one_error_line(proc) == f"error: {refusal}"
    assert not out.exists()


def test_default_recipe_resolves_the_expected_stages(tmp_path):
    cfg = compose_recipe("minilm_int8_cpu")
    plan = pipeline.plan(cfg, tmp_path)
    assert [m.name for m, _ in pipeline.order(plan.stages)] == ["auto"]  # the engine race
    assert plan.needs_calibration
    assert plan.final_dir == tmp_path / "artifact"
    assert cfg.gate.min_speedup == 1.5 and cfg.gate.min_cosine == 0.99


def test_overrides_reach_every_setting(tmp_path):
    cfg = compose_recipe(
        "minilm_int8_cpu",
        "gate.min_speedup=2.0",
        "evaluate.batch_sizes=[1,8]",
        "engine.params.time_budget_s=60",
        "engine.params.candidates=[ort_fp32,openvino_f32]",
    )
    assert cfg.gate.min_speedup == 2.0
    assert list(cfg.evaluate.batch_sizes) == [1, 8]
    plan = pipeline.plan(cfg, tmp_path)
    race_cfg = dict((m.name, c) for m, c in plan.stages)["auto"]
    assert race_cfg.time_budget_s == 60 and race_cfg.candidates == ["ort_fp32", "openvino_f32"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "gate.min_cosine=null",
                "gate.min_mean_cosine=null",
                "gate.min_topk_agreement=null",
                "gate.min_speedup=null",
            ],
            "the gate checks nothing",
        ),
        (["quantize.method=int3"], "quantize.method='int3' is not a registered method"),
        (["engine.params.candidates=[ort_fp32,bogus]"], r"unknown \['bogus'\]"),
        (["quantize=ort_int8_dynamic"], "engine.method=auto builds its own quantized candidates"),
        (["engine.method=none"], "engine.method is required"),
        (["evaluate.batch_sizes=[]"], "evaluate.batch_sizes"),
        (["model.task=speech"], "model.task=speech is not supported"),
        (["evaluate.overlap=ignore"], "evaluate.overlap=ignore"),
        (["evaluate.data.count=8"], "more than the 8 evaluation samples"),
    ],
)
def test_plan_refuses_bad_recipes(overrides, message, tmp_path):
    cfg = compose_recipe("minilm_int8_cpu", *overrides)
    with pytest.raises(RecipeError, match=message):
        pipeline.plan(cfg, tmp_path)
