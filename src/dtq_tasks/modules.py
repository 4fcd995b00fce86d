"""Importing the task modules: what the worker runs and what the API and ``dtq submit`` check
submissions against (DESIGN 9).

Like uvicorn's ``--app-dir``, the current directory is put first on ``sys.path`` before the
modules are imported, so ``examples/`` loads from the project root. Importing a module
registers its ``@task`` handlers (:mod:`dtq_tasks.registry`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from dtq.config import Settings
from dtq.errors import ConfigError
from dtq_tasks.registry import Handler, registry

__all__ = ["TaskModules", "load_task_modules", "load_task_types"]


@dataclass(frozen=True)
class TaskModules:
    """The handlers registered once the task modules are imported, by name, and the payload
    models of those that declare one."""

    handlers: Mapping[str, Handler]
    payload_models: Mapping[str, type[BaseModel]]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.handlers)


def load_task_modules(modules: Sequence[str]) -> TaskModules:
    """Import ``modules`` (the current directory first on ``sys.path``) and return what is
    registered. ConfigError, one line: a module whose import fails, whatever it raises (the
    exception's type and text are named); no handler registered at all."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ConfigError(
                f"cannot import task module {name!r} (DTQ_TASK_MODULES or --tasks): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    handlers = registry()
    if not handlers:
        raise ConfigError(
            "no task handlers registered: give --tasks MODULE or set DTQ_TASK_MODULES "
            f"(modules imported: {', '.join(modules) or 'none'})"
        )
    models = {n: h.payload_model for n, h in handlers.items() if h.payload_model is not None}
    return TaskModules(handlers, models)


def load_task_types(
    settings: Settings,
) -> tuple[frozenset[str] | None, Mapping[str, type[BaseModel]]]:
    """What a producer (the API, ``dtq submit``) checks submissions against: the registered
    task types of ``DTQ_TASK_MODULES`` and their payload models. ``DTQ_TASK_MODULES`` empty:
    ``(None, {})``, any well-formed task type is accepted."""
    modules = settings.task_module_list
    if not modules:
        return None, {}
    loaded = load_task_modules(modules)
    return loaded.names, loaded.payload_models
