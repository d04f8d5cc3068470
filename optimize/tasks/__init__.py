"""Tasks: what a kind of model takes and returns, its PyTorch baseline, and how it is evaluated.

A task is one module in this package that calls `register_task` (`model.task=NAME`). Stages and the
pipeline ask the task for what differs between, say, a sentence encoder and a causal LM;
everything else is shared.
"""

from __future__ import annotations

import importlib
import pkgutil

from optimize.errors import RecipeError
from optimize.tasks.base import Task

_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    _TASKS[task.name] = task
    return task


register_task(Task())


def _load_task_modules() -> None:
    """Import every module of this package: each registers its task."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def get(name: str) -> Task:
    _load_task_modules()
    try:
        return _TASKS[name]
    except KeyError:
        raise RecipeError(f"model.task={name} is not supported (known: {', '.join(sorted(_TASKS))})") from None


def names() -> list[str]:
    _load_task_modules()
    return sorted(_TASKS)
