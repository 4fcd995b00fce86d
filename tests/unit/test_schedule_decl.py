"""Schedules declared next to their handler (``@task(..., schedule=...)``): checked when the
module is imported, named after their task unless named, refused when two tasks claim one name.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from dtq_tasks import TaskRegistrationError, code_schedules, cron, every, task

registry_module = importlib.import_module("dtq_tasks.registry")  # the module, not the function


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    """Each test declares into an empty registry, and leaves the process's as it found it."""
    handlers = dict(registry_module._REGISTRY)
    schedules = dict(registry_module._SCHEDULES)
    registry_module._REGISTRY.clear()
    registry_module._SCHEDULES.clear()
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(handlers)
    registry_module._SCHEDULES.clear()
    registry_module._SCHEDULES.update(schedules)


def _noop(payload: dict[str, Any], ctx: Any) -> None:
    return None


def test_a_declared_cron_schedule_is_named_after_its_task() -> None:
    task("Reports.Daily", schedule=cron("0 7 * * *", tz="Europe/Paris", payload={"k": 1}))(_noop)
    declared = code_schedules()
    assert list(declared) == ["reports-daily"]
    d = declared["reports-daily"]
    assert (d.cron, d.tz, d.task_type, d.payload) == (
        "0 7 * * *",
        "Europe/Paris",
        "Reports.Daily",
        {"k": 1},
    )


def test_several_schedules_with_their_own_names() -> None:
    task("ping", schedule=[every("30s", name="ping-fast"), every("1h", name="ping-slow")])(_noop)
    declared = code_schedules()
    assert {n: d.every for n, d in declared.items()} == {"ping-fast": 30, "ping-slow": 3600}


@pytest.mark.parametrize(
    ("decl", "message"),
    [
        (cron("61 * * * *"), "cron"),
        (cron("0 7 * * *", tz="Mars/Base"), "time zone"),
        (every("5x"), "every"),
        (every(30, overlap="sometimes"), "overlap"),
        (every(30, name="Bad Name"), "schedule name"),
        (every(30, metadata={"schedule": "x"}), "metadata.schedule"),
    ],
)
def test_a_bad_declaration_fails_at_import(decl: Any, message: str) -> None:
    with pytest.raises(TaskRegistrationError, match=message):
        task("job", schedule=decl)(_noop)
    assert "job" not in code_schedules()


def test_schedule_takes_only_declarations() -> None:
    with pytest.raises(TaskRegistrationError, match=r"cron\(...\) or every\(...\)"):
        task("job", schedule="0 7 * * *")(_noop)  # type: ignore[arg-type]


def test_two_tasks_cannot_declare_one_schedule_name() -> None:
    task("a", schedule=every(60, name="shared"))(_noop)
    with pytest.raises(TaskRegistrationError, match="already declared by task 'a'"):
        task("b", schedule=every(60, name="shared"))(_noop)
