"""The run's log: what the console shows, and what the artifact keeps.

Quiet by default: the console shows this tool's own lines (INFO and above from `optimize.*`: a line per
stage, warnings, errors), every error, and library warnings that are not known noise. Everything is
kept in the run's log, shipped inside the artifact as `run.log`: library warnings and INFO lines (ONNX
Runtime's quantizer, torch's exporter, NNCF's accuracy-control narrative), Python warnings, the final
state of libraries' progress bars, and this tool's detail lines (DEBUG: what the report tables repeat).
`-v` (or `hydra.verbose=true`) shows all of it on the console as well, as the libraries print it.

Libraries reach the console four ways, each routed here by what it is:
- loggers that propagate to the root logger (ONNX Runtime logs on the root logger itself): a filter on
  the root logger's console handlers (Hydra's);
- loggers with console handlers of their own that do not propagate (torch's registered loggers, NNCF's,
  transformers'): the same filter on those handlers, and the run's log beside them; a library that is
  imported later gets them when it is imported;
- Python warnings (`warnings.warn`): shown when they come from this project or are RuntimeWarnings (a
  numerical problem), kept in the log in every case;
- rich progress bars (NNCF's), drawn on rich's global console: that console writes into the log.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import io
import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

LOG_FILE = "run.log"
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
# Library lines known to say nothing to the user, as (logger name or its parent, start of the message).
NOISE = (
    # ONNX Runtime's quantizer, once per quantization (the sensitivity search quantizes many times).
    ("root", "Please consider to run pre-processing before quantization"),
    # torch's ONNX exporter registering torchvision's operators, once per process.
    ("torch.onnx", "torchvision is not installed"),
)
# Modules that attach console handlers of their own to non-propagating loggers when imported (torch does at
# the end of its __init__).
LIBRARY_CONSOLES = ("torch", "nncf.common.logging.logger")
# Where this project's own code lives: its warnings are meant for the user.
ROOT = Path(__file__).resolve().parents[1]
OWN_PACKAGES = tuple(str(ROOT / package) for package in ("optimize", "engines", "calibration", "serve"))

_state = {"verbose": False, "first_job": True}


class ConsoleFilter(logging.Filter):
    """What a console handler lets through: everything with -v; else errors, this tool's INFO and up,
    and library warnings that are not known noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _state["verbose"] or record.levelno >= logging.ERROR:
            return True
        if record.name == "optimize" or record.name.startswith("optimize."):
            return record.levelno >= logging.INFO
        return record.levelno >= logging.WARNING and not is_noise(record)


def is_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return any(
        (record.name == name or record.name.startswith(name + ".")) and message.startswith(start)
        for name, start in NOISE
    )


class RunLog(logging.Handler):
    """Every record of the run, formatted, in memory until `write_into` puts it in the artifact."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter(FORMAT))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:
            self.handleError(record)


RUN_LOG = RunLog()
CONSOLE = ConsoleFilter()


def install(verbose: bool) -> None:
    """At the start of the command, before the recipe is checked: Python warnings and libraries that
    are already imported (or are imported later) are routed through the console filter and the log."""
    _state["verbose"] = verbose
    logging.getLogger("optimize").setLevel(logging.DEBUG)  # detail lines reach the log; the filter hides them
    warnings.showwarning = _showwarning
    _adopt_library_loggers()
    for name in LIBRARY_CONSOLES:
        if name not in sys.modules and _installed(name):
            sys.meta_path.insert(0, _AfterImport(name, _adopt_library_loggers))


def start_job(verbose: bool) -> None:
    """Once Hydra has set up the job's logging: the filter on its console handlers, and the run's log.
    A sweep runs its jobs one after another in this process: each job's log starts empty (the first
    keeps what was logged while its recipe was checked)."""
    _state["verbose"] = _state["verbose"] or verbose
    root = logging.getLogger()
    for handler in root.handlers:
        if _is_console(handler) and CONSOLE not in handler.filters:
            handler.addFilter(CONSOLE)
    if RUN_LOG not in root.handlers:
        root.addHandler(RUN_LOG)
    _adopt_library_loggers()
    if not _state["verbose"] and _installed("rich"):
        import rich

        rich.reconfigure(file=_LogStream("rich"))  # the global console, which libraries' progress bars use
    if not _state["first_job"]:
        RUN_LOG.lines.clear()
    _state["first_job"] = False


def write_into(stage: Path) -> None:
    """The run's log so far as LOG_FILE in the artifact being built (before its manifest lists the files)."""
    (stage / LOG_FILE).write_text("\n".join(RUN_LOG.lines) + "\n")


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    text = warnings.formatwarning(message, category, filename, lineno, line)
    record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text.rstrip(), None, None)
    RUN_LOG.handle(record)
    if _state["verbose"] or issubclass(category, RuntimeWarning) or str(filename).startswith(OWN_PACKAGES):
        (file or sys.stderr).write(text)


def _is_console(handler: logging.Handler) -> bool:
    """A handler that prints on the terminal (a file handler, torch's trace handler, the log are not)."""
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return isinstance(handler, logging.StreamHandler) and handler.stream in streams


def _adopt_library_loggers() -> None:
    """Loggers that do not propagate to the root logger and print on their own console handlers: the
    filter on those handlers, the run's log beside them."""
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger) or logger.propagate:
            continue
        consoles = [h for h in logger.handlers if _is_console(h)]
        for handler in consoles:
            if CONSOLE not in handler.filters:
                handler.addFilter(CONSOLE)
        if consoles and RUN_LOG not in logger.handlers:
            logger.addHandler(RUN_LOG)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `hook` right after the module `name` has been imported (once), by wrapping its loader."""

    def __init__(self, name: str, hook: Callable[[], None]) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the spec is found by the other finders, and this runs once
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, hook = loader.exec_module, self.hook

        def exec_then_hook(module) -> None:
            exec_module(module)
            hook()

        loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec


class _LogStream(io.TextIOBase):
    """A text stream whose lines go to the run's log (rich's console draws progress bars into it)."""

    def __init__(self, name: str) -> None:
        self.name, self.pending = name, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if line.strip():
                RUN_LOG.handle(logging.LogRecord(self.name, logging.INFO, "", 0, line.rstrip(), None, None))
        return len(text)
