"""The public surface is explicit (like httpx's test of the same name): every public package
and core module has a non-empty ``__all__`` that names only what exists; every public class or
function a module defines, or a package re-exports from its modules, is in it; a package
exports only its own classes and functions. A check that finds nothing to check fails.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import pytest

import dtq

PACKAGES = [
    "dtq",
    "dtq.admin",
    "dtq.api",
    "dtq.metrics",
    "dtq.testing",
    "dtq.worker",
    "dtq_cli",
    "dtq_tasks",
]
"""Every public package: each names its surface in ``__all__``."""

MODULES = [
    "dtq.client",
    "dtq.clock",
    "dtq.config",
    "dtq.devcluster",
    "dtq.devsentinel",
    "dtq.devserver",
    "dtq.errors",
    "dtq.events",
    "dtq.keys",
    "dtq.log",
    "dtq.models",
    "dtq.retry",
    "dtq.schedules",
    "dtq.ticks",
    "dtq.scripts",
    "dtq.sentinel",
    "dtq.store",
    "dtq.records",
]
"""Core modules whose ``__all__`` is checked too."""

REEXPORTS = {("dtq", "RateLimited"): "dtq_tasks.errors"}
"""The deliberate exceptions to "a package exports only its own": ``from dtq import
RateLimited`` is the handler contract's exception (docs/limits.md), defined in dtq_tasks."""


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def _definitions(module: ModuleType) -> dict[str, object]:
    """The classes and functions bound to a public name of ``module`` that it defines (a
    package: that it or one of its modules defines, which is what it re-exports). An alias
    (``models.S = TaskStatus``) is not a definition, nor is what it imports from elsewhere."""
    name = module.__name__
    return {
        attr: obj
        for attr, obj in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and (obj.__module__ == name or obj.__module__.startswith(name + "."))
        and obj.__name__ == attr
    }


@pytest.mark.parametrize("name", PACKAGES + MODULES)
def test_all_names_exist(name: str) -> None:
    module = _module(name)
    exported = module.__all__
    assert exported, f"{name}.__all__ is empty: its public surface is not named"
    assert len(exported) == len(set(exported)), f"{name}.__all__ has duplicates"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("name", PACKAGES + MODULES)
def test_public_definitions_exported(name: str) -> None:
    module = _module(name)
    defined = _definitions(module)
    assert defined, f"{name}: no public class or function of its own found, nothing to check"
    unlisted = set(defined) - set(module.__all__)
    assert not unlisted, f"{name}: public but not in __all__: {sorted(unlisted)}"


@pytest.mark.parametrize("name", PACKAGES)
def test_package_exports_only_its_own(name: str) -> None:
    """A class or function a package exports is its own, not one it imported from elsewhere."""
    module = _module(name)
    foreign = [
        attr
        for attr in module.__all__
        if (inspect.isclass(obj := getattr(module, attr)) or inspect.isfunction(obj))
        and not (obj.__module__ == name or obj.__module__.startswith(name + "."))
        and REEXPORTS.get((name, attr)) != obj.__module__
    ]
    assert not foreign, f"{name}.__all__ re-exports what it does not define: {foreign}"


def test_key_constants_exported() -> None:
    from dtq import keys

    constants = {
        attr
        for attr, value in vars(keys).items()
        if attr.isupper() and isinstance(value, str) and value.startswith("dtq:")
    }
    assert constants, "no key constant found: the check would be vacuous"
    assert constants <= set(keys.__all__), sorted(constants - set(keys.__all__))


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
        module = getattr(dtq, name).__module__
        assert module.startswith("dtq.") or REEXPORTS.get(("dtq", name)) == module, name
    assert isinstance(dtq.__version__, str)


def test_every_error_has_a_code() -> None:
    from dtq import errors

    codes = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DtqError)
        codes[cls.code] = name
    assert len(codes) == len(errors.__all__), "two errors share a code"
