"""Fuzzing the pipeline's command line over random overrides: every one is planned (composed and
checked as `python -m optimize` does before Hydra runs anything) or refused with exit 2 and one line;
never an internal error (exit 3). In process and plan-only, so a few hundred cases take seconds; a
handful go through the real command line in a subprocess."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support.cli import one_error_line, run_optimize  # noqa: E402


def leaf_keys() -> list[str]:
    from omegaconf import OmegaConf

    from optimize.__main__ import compose_recipe
    from optimize.config import register_schema

    register_schema()
    cfg = compose_recipe([])
    keys = []

    def walk(node, prefix):
        for key in node:
            value = node._get_node(key)
            path = f"{prefix}{key}"
            if OmegaConf.is_dict(value):
                walk(value, path + ".")
            else:
                keys.append(path)

    walk(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), "")
    return keys


KEYS = leaf_keys()
GROUPS = ["recipe", "model", "calibration", "quantize", "engine", "gate", "prune", "distill", "evaluate"]
VALUES = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "100000",
            "1e308",
            "nan",
            "inf",
            "null",
            "true",
            "false",
            "[]",
            "[0]",
            "[1,-1]",
            "{}",
            "''",
            "none",
            "auto",
            "/dev/zero",
            "/proc/self",
            "/",
            "..",
            "~",
            "x" * 300,
            "${oc.env:NOPE}",
            "${model.source}",
            "'\\ud800'",
            "pkg://nope/x",
            "/etc/passwd",
            "a/b",
            "data",
            "random",
            "drop",
            "error",
            "cpython_docs",
            "text_file",
        ]
    ),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
)


def key_strategy():
    typo = st.builds(lambda k, c: k[:-1] + c, st.sampled_from(KEYS), st.sampled_from("xyz_"))
    return st.one_of(
        st.sampled_from(KEYS),
        st.sampled_from(GROUPS),
        typo,
        st.builds(lambda k: f"+{k}", st.one_of(st.sampled_from(KEYS), typo)),
        st.builds(lambda k: f"++{k}", st.sampled_from(KEYS)),
        st.builds(lambda k: f"~{k}", st.sampled_from(KEYS)),
    )


OVERRIDES = st.lists(st.builds(lambda k, v: f"{k}={v}", key_strategy(), VALUES), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OVERRIDES)
def test_random_overrides_plan_or_refuse_never_crash(tmp_path_factory, overrides):
    from optimize.__main__ import precheck

    out = tmp_path_factory.mktemp("fuzz")
    argv = [*overrides, f"hydra.run.dir={out / 'run'}"]
    try:
        precheck(argv)  # returns when the recipe plans; a refusal is SystemExit(2)
    except SystemExit as exc:
        assert exc.code == 2, f"{argv}: exit {exc.code}"
    assert not (out / "run").exists()


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["+gate.min_cosin=0.999"], "gate.min_cosin"),
        (["model.max_length=0"], "max_length"),
        (["evaluate.data.count=-1", "evaluate.batch_sizes=[1]"], "count"),
        (["output_dir=/dev/null"], "/dev/null"),
        (["model.source=/dev/zero"], "/dev/zero"),
    ],
)
def test_a_handful_through_the_real_command_line(tmp_path, overrides, fragment):
    one_error_line(run_optimize(*overrides, f"hydra.run.dir={tmp_path / 'run'}"), fragment)
    assert not (tmp_path / "run").exists()
