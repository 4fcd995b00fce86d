"""The public surface is explicit: ``__all__`` of each core module names only what exists, and
every public class or function a module defines is in it (like httpx's test of the same name).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import pytest

import dtq

CORE_MODULES = [
    "dtq",
    "dtq.admin",
    "dtq.client",
    "dtq.clock",
    "dtq.config",
    "dtq.devserver",
    "dtq.errors",
    "dtq.events",
    "dtq.keys",
    "dtq.log",
    "dtq.metrics",
    "dtq.models",
    "dtq.retry",
    "dtq.scripts",
    "dtq.store",
    "dtq.views",
    "dtq_tasks",
]


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", CORE_MODULES)
def test_all_names_exist(name: str) -> None:
    module = _module(name)
    exported = module.__all__
    assert len(exported) == len(set(exported)), f"{name}.__all__ has duplicates"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("name", CORE_MODULES[1:])
def test_public_definitions_exported(name: str) -> None:
    module = _module(name)
    defined = {
        attr
        for attr, obj in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == name
        and obj.__name__ == attr  # an alias (models.S = TaskStatus) is not a definition
    }
    unlisted = defined - set(module.__all__)
    assert not unlisted, f"{name}: public but not in __all__: {sorted(unlisted)}"


def test_key_constants_exported() -> None:
    from dtq import keys

    constants = {
        attr
        for attr, value in vars(keys).items()
        if attr.isupper() and isinstance(value, str) and value.startswith("dtq:")
    }
    assert constants <= set(keys.__all__)


def test_package_surface() -> None:
    assert set(dtq.__all__) >= {
        "DtqError",
        "HistoryEntry",
        "Queue",
        "Settings",
        "SyncQueue",
        "Task",
        "TaskStatus",
        "connect",
        "connect_sync",
        "load_settings",
    }
    for name in dtq.__all__:
        assert getattr(dtq, name).__module__.startswith("dtq."), name
    assert isinstance(dtq.__version__, str)


def test_every_error_has_a_code() -> None:
    from dtq import errors

    codes = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DtqError)
        codes[cls.code] = name
    assert len(codes) == len(errors.__all__), "two errors share a code"
