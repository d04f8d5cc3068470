"""`python -m optimize recipe=NAME key=value ...`

Exit codes: 0 the gate passed, 1 the gate failed (artifact kept, marked failed), 2 the recipe or an
input is bad (one line on stderr, nothing written), 3 an internal error (a bug: traceback shown).
"""
from __future__ import annotations

import logging
import signal
import sys
import traceback
from pathlib import Path

from optimize import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL_ERROR, EXIT_PASSED
from optimize.errors import RecipeError

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "recipes")
HYDRA_VERSION_BASE = "1.3"
# Hydra's flags: those that mean "do not run a job here", and those that take a value.
_NO_JOB_FLAGS = {"-m", "--multirun", "-h", "--help", "--hydra-help", "-i", "--info", "-sc", "--shell-completion"}
_VALUED_FLAGS = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                 "--config-dir", "--experimental-rerun", "-i", "--info", "-sc", "--shell-completion"}
log = logging.getLogger("optimize")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def precheck(argv: list[str]) -> None:
    """Compose the recipe once before Hydra runs it, so a bad override or recipe is one line and exit 2
    (Hydra itself prints several lines and exits 1, which CI would read as a failed gate)."""
    from hydra import compose, initialize_config_dir

    if _NO_JOB_FLAGS & {a.split("=")[0] for a in argv}:
        return  # sweeps are composed per job; help and info need no check
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=HYDRA_VERSION_BASE):
            compose("config", overrides=overrides_of(argv), return_hydra_config=True)
    except Exception as exc:  # Hydra and OmegaConf raise many types; all mean "bad recipe"
        fail(_one_line(exc))


def overrides_of(argv: list[str]) -> list[str]:
    """The key=value overrides of a command line, without Hydra's flags and their values."""
    overrides, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _VALUED_FLAGS  # "--cfg job": the next word is the flag's value
        else:
            overrides.append(arg)
    return overrides


def _one_line(exc: BaseException | None) -> str:
    """The most specific message of an exception chain, on one line."""
    messages = []
    while exc is not None:
        text = " ".join(str(exc).split("\n")[0].split())
        if text:
            messages.append(text)
        exc = exc.__cause__ or exc.__context__
    messages = [m for m in dict.fromkeys(messages) if "$VALUE" not in m]
    return "; ".join(messages) or "invalid recipe"


def main() -> None:
    from optimize.config import register_schema

    register_schema()
    precheck(sys.argv[1:])
    import hydra

    @hydra.main(config_path=CONFIG_DIR, config_name="config", version_base=HYDRA_VERSION_BASE)
    def entry(cfg) -> None:
        sys.exit(run_job(cfg))

    entry()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_job(cfg) -> int:
    from hydra.core.hydra_config import HydraConfig

    from optimize import pipeline, report

    # Libraries log at INFO on the root logger (ONNX Runtime's quantizer does, per node): keep their
    # warnings, and this tool's own progress.
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("optimize").setLevel(logging.INFO)
    # SIGTERM (CI cancelling a job) unwinds like Ctrl-C, so the staging directory is removed.
    signal.signal(signal.SIGTERM, _interrupt)
    hydra_cfg = HydraConfig.get()
    recipe = hydra_cfg.runtime.choices.get("recipe") or "custom"
    try:
        manifest, path = pipeline.run(cfg, recipe, Path(hydra_cfg.runtime.output_dir))
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("internal error: this is a bug in optimize; nothing was written", file=sys.stderr)
        return EXIT_INTERNAL_ERROR
    print(report.render(manifest, path))
    return EXIT_PASSED if manifest["gate"]["passed"] else EXIT_GATE_FAILED


if __name__ == "__main__":
    main()
