"""`python -m optimize recipe=NAME key=value ...`

Exit codes: 0 the gate passed, 1 the gate failed (artifact kept, marked failed), 2 the recipe or an
input is bad (one line on stderr, nothing written), 3 an internal error (a bug: traceback shown),
130 interrupted by SIGINT (Ctrl-C), 143 stopped by SIGTERM (nothing written in either case).
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NoReturn

from optimize import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL_ERROR, EXIT_PASSED, EXIT_SIGINT, EXIT_SIGTERM
from optimize.errors import RecipeError, bad_input_message

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "recipes")
HYDRA_VERSION_BASE = "1.3"
# Hydra's flags: those that run a sweep, those that mean "do not run a job here", and those that take a value.
_MULTIRUN_FLAGS = {"-m", "--multirun"}
_HELP_FLAGS = {"-h", "--help", "--hydra-help", "-i", "--info", "-sc", "--shell-completion"}
_VERBOSE_FLAGS = {"-v", "--verbose"}
_VALUED_FLAGS = {
    "-c",
    "--cfg",
    "-p",
    "--package",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--experimental-rerun",
    "-i",
    "--info",
    "-sc",
    "--shell-completion",
}
LAUNCHER_PLUGINS = (
    "joblib and submitit come with pip install 'optimize[sweeps]'; Ray needs pip install hydra-ray-launcher"
)
# `+key` may add keys only inside these free-form sections; anywhere else the key must be in the schema.
# model.inputs is keyed by the model's input names; each entry is still typed (InputSpec). The race's
# per-candidate maps are keyed by candidate names, which its config checks (EngineRaceConfig.validate).
FREE_FORM = (
    "evaluate.task_params.",
    "model.inputs.",
    "hydra.",
    "engine.params.candidate_budget_s.",
    "engine.params.candidate_params.",
)
log = logging.getLogger("optimize")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def precheck(argv: list[str]) -> None:
    """Compose the recipe and plan it once before Hydra runs it, so a bad override, recipe or input
    the plan can see is one line and exit 2 with nothing written (Hydra itself prints several lines
    and exits 1, which CI would read as a failed gate, and writes .hydra/ and a log first). A sweep
    is checked job by job, before any job is launched."""
    check_flags(argv)
    flags = {a.split("=")[0] for a in argv}
    overrides = overrides_of(argv)
    if flags & _HELP_FLAGS:
        return  # help and info need no check
    if flags & _MULTIRUN_FLAGS or "hydra.mode=MULTIRUN" in overrides:
        if flags & {"-c", "--cfg"}:
            fail("--cfg prints one job's recipe: give it without --multirun (-m) and without swept values")
        for job in sweep_jobs(overrides):
            check_job(job, plan=True, sweep=True)
        return
    check_job(overrides, plan=not {"-c", "--cfg"} & set(argv))


def check_flags(argv: list[str]) -> None:
    """The command line parsed as Hydra will parse it, so an unknown flag, or an override after a flag
    (`--cfg job key=value`: argparse takes no positionals after the flag), is one line and exit 2
    instead of Hydra's usage block."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:
        hint = ""
        if "unrecognized arguments" in message and any(not a.startswith("-") for a in message.split(":", 1)[1].split()):
            hint = " (key=value overrides go before Hydra's flags: recipe=NAME key=value --cfg job)"
        fail(f"{' '.join(message.split())}{hint}")

    parser.error = refuse  # type: ignore[method-assign]
    parser.parse_args(argv)


def check_job(overrides: list[str], plan: bool, sweep: bool = False) -> None:
    """One job's recipe composed and (plan=True) planned, and for a sweep its launcher; a refusal is one
    line and exit 2."""
    try:
        cfg = compose_recipe(overrides)
    except RecipeError as exc:
        fail(str(exc))
    except Exception as exc:  # Hydra and OmegaConf raise many types; all mean "bad recipe"
        line = _one_line(exc)
        if "Could not load 'hydra/launcher/" in line:
            line += f" (a launcher plugin that is not installed? {LAUNCHER_PLUGINS})"
        fail(line)
    if sweep:
        check_launcher(cfg)
    if not plan:
        return  # printing the recipe loads and checks no inputs
    try:
        from optimize import pipeline

        pipeline.plan(cfg, Path(tempfile.gettempdir()) / "optimize-precheck")
    except Exception as exc:
        message = bad_input_message(exc)
        if message is None:
            internal_error("nothing was written")
        fail(message)


def internal_error(what: str) -> NoReturn:
    """A bug: its traceback, and exit 3 (Python's own exit 1 would read as a failed gate)."""
    traceback.print_exc()
    print(f"internal error: this is a bug in optimize; {what}", file=sys.stderr)
    sys.exit(EXIT_INTERNAL_ERROR)


def check_launcher(cfg) -> None:
    """A SLURM launcher off a SLURM node fails deep inside submitit with a traceback (it looks for
    srun, as done here): say so in one line, and what runs here instead."""
    target = str(cfg.hydra.launcher.get("_target_", ""))
    if target.endswith("SlurmLauncher") and shutil.which("srun") is None:
        fail(
            "hydra/launcher=slurm submits SLURM jobs, and this machine has no srun (not a SLURM node): "
            "run the sweep from a login node of the cluster, or rehearse it here with hydra/launcher=slurm_local"
        )


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands the swept lists; a fixed output_dir
    shared by several jobs is refused (the second job would find the first one's artifact there)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception as exc:
        fail(_one_line(exc))
    outputs = [o.split("=", 1)[1] for job in jobs for o in job if o.split("=", 1)[0].lstrip("+") == "output_dir"]
    shared = [o for o in set(outputs) if outputs.count(o) > 1 and "${" not in o and o not in ("null", "")]
    if shared:
        fail(
            f"output_dir={shared[0]} is the same for {outputs.count(shared[0])} jobs of the sweep; leave it unset "
            f"(each job writes SWEEP_DIR/NUM/artifact) or make it differ per job"
        )
    return jobs


def compose_recipe(overrides: list[str]):
    """The composed recipe (with Hydra's own config), after refusing `+key`/`++key` overrides that add a
    key the schema does not have outside a free-form section (a typo such as `+gate.min_cosin=0.999`
    would otherwise be accepted and never checked)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(overrides)
    adds = [o for o in parsed if (o.is_add() or o.is_force_add()) and "." in o.key_or_group]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=HYDRA_VERSION_BASE):
        if adds:
            others = [text for text, o in zip(overrides, parsed) if o not in adds]
            base = compose("config", overrides=others, return_hydra_config=True)
            for o in adds:
                key = o.key_or_group
                if key.startswith(FREE_FORM) or OmegaConf.select(base, key, default=_ABSENT) is not _ABSENT:
                    continue
                raise RecipeError(
                    f"+{key}: no such key in the recipe schema (a typo?); `+` adds keys only "
                    f"under {', '.join(p.rstrip('.') for p in FREE_FORM)}"
                )
        return compose("config", overrides=overrides, return_hydra_config=True)


_ABSENT = object()


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
    from optimize import runlog
    from optimize.config import register_schema

    # -v is this tool's flag, not Hydra's: the console shows every library line the run's log keeps.
    verbose = bool(_VERBOSE_FLAGS & set(sys.argv[1:]))
    sys.argv[1:] = [a for a in sys.argv[1:] if a not in _VERBOSE_FLAGS]
    runlog.install(verbose)
    register_schema()
    precheck(sys.argv[1:])
    import hydra

    from optimize import sweep

    @hydra.main(config_path=CONFIG_DIR, config_name="config", version_base=HYDRA_VERSION_BASE)
    def entry(cfg) -> int:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        code, artifact = run_job(cfg)
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(code)
        # In a sweep the job returns: an exit here would end the whole sweep after this job.
        sweep.record_job(code, hydra_cfg, artifact)
        return code

    entry()
    # Reached after a multirun (a single run exits inside entry): the worst job's code; or after
    # --cfg, --help and --info, which run no job.
    if sweep.result["exit_code"] is not None:
        sys.exit(sweep.result["exit_code"])


_signal_received: list[int] = []


def _interrupt(signum, frame):
    _signal_received.append(signum)
    raise KeyboardInterrupt


def run_job(cfg) -> tuple[int, Path | None]:
    """Run one recipe: its exit code, and the artifact it wrote (None when nothing was written)."""
    from hydra.core.hydra_config import HydraConfig

    from optimize import pipeline, runlog
    from optimize.reports import ci, console

    hydra_cfg = HydraConfig.get()
    # Libraries log at INFO on the root logger (ONNX Runtime's quantizer does, per node): keep their
    # warnings (hydra.verbose: everything); the console shows what runlog lets through.
    if hydra_cfg.verbose is not True:
        logging.getLogger().setLevel(logging.WARNING)
    runlog.start_job(verbose=bool(hydra_cfg.verbose))
    # SIGTERM (CI cancelling a job) unwinds like Ctrl-C, so the staging directory is removed.
    signal.signal(signal.SIGTERM, _interrupt)
    recipe = own_model_name(cfg, list(hydra_cfg.overrides.task)) or hydra_cfg.runtime.choices.get("recipe") or "custom"
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        manifest, path = pipeline.run(cfg, recipe, run_dir)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return (EXIT_SIGTERM if signal.SIGTERM in _signal_received else EXIT_SIGINT), None
    except Exception as exc:
        message = bad_input_message(exc)
        if message is None:
            traceback.print_exc()
            print("internal error: this is a bug in optimize; nothing was written", file=sys.stderr)
            return EXIT_INTERNAL_ERROR, None
        print(f"error: {message}", file=sys.stderr)
        _remove_hydra_outputs(run_dir, hydra_cfg)
        return EXIT_BAD_INPUT, None
    print(console.render(manifest, path))
    try:
        for line in ci.export(manifest, path, cfg.report.junit):
            print(line)
        _publish(cfg, manifest, path)
    except RecipeError as exc:  # the artifact stays: only where it was to go failed
        print(f"error: {exc} (the artifact is kept at {path})", file=sys.stderr)
        return EXIT_BAD_INPUT, path
    except Exception:  # not exit 1 from Hydra, which reads as a failed gate
        traceback.print_exc()
        print(f"internal error: this is a bug in optimize; the artifact is kept at {path}", file=sys.stderr)
        return EXIT_INTERNAL_ERROR, path
    return (EXIT_PASSED if manifest["gate"]["passed"] else EXIT_GATE_FAILED), path


def own_model_name(cfg, overrides: list[str]) -> str | None:
    """Bring your own model (`model.source=...` or `model=NAME` without `recipe=`): the default recipe's
    settings apply, but its name and model.hub_id describe the default model, and the artifact, the
    registries and the model card would claim it. The run is named after the source instead (its file's
    stem or its folder's name), and model.hub_id is dropped unless given too. None for a recipe run."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if "recipe" in keys or not keys & {"model", "model.source"}:
        return None
    if "model.source" in keys and "model.hub_id" not in keys:
        cfg.model.hub_id = None
    source = str(cfg.model.source).rstrip("/")
    path = Path(source.split("://", 1)[-1])
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.name if Path(source).is_dir() else path.stem).strip("._-")
    return name or "custom"


def _publish(cfg, manifest: dict, path: Path) -> None:
    """publish=NAME: send the artifact to a registry; a failed gate is sent only with publish.allow_failed."""
    from optimize import publish

    settings = publish.settings_of(cfg.publish)
    if settings.get("to", publish.NONE) == publish.NONE:
        return
    if not manifest["gate"]["passed"] and not settings.get("allow_failed"):
        print(f"not published to {settings['to']}: the gate failed (publish.allow_failed=true sends it tagged failed)")
        return
    print(publish.publish(path, settings))


def _remove_hydra_outputs(run_dir: Path, hydra_cfg) -> None:
    """A refused run writes nothing: remove what Hydra wrote for it (.hydra/, the job's log), and the
    run directory if that leaves it empty."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            # Removed, not only closed: a closed FileHandler reopens its file on the next record, and
            # in a sweep the launcher logs on after the job (submitit does), into a removed folder.
            handler.close()
            root.removeHandler(handler)
    if hydra_cfg.output_subdir:
        shutil.rmtree(run_dir / hydra_cfg.output_subdir, ignore_errors=True)
    (run_dir / f"{hydra_cfg.job.name}.log").unlink(missing_ok=True)
    try:
        run_dir.rmdir()  # only when empty
    except OSError:
        pass


if __name__ == "__main__":
    main()
