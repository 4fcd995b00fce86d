"""The handler registry: ``@task("name")`` and the context a handler receives (contract 15).

A worker executes only handlers registered here (contract section 13): the task_type of an entry
is looked up by name, never imported or evaluated. Registration happens when the task module is
imported; a second handler under a name that is taken is an error at that import.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, TypeVar

from pydantic import BaseModel

from dtq.models import TASK_TYPE_RE

__all__ = [
    "Handler",
    "HandlerFn",
    "TaskContext",
    "TaskRegistrationError",
    "get_handler",
    "registry",
    "task",
]

HandlerFn = Callable[[dict[str, Any], "TaskContext"], Any | Awaitable[Any]]
F = TypeVar("F", bound=Callable[..., Any])


class TaskRegistrationError(ValueError):
    """A bad ``@task`` registration: invalid name, duplicate name, wrong payload_model."""


@dataclass(frozen=True)
class TaskContext:
    """What a handler knows about the execution it is part of.

    ``deadline`` is when the worker stops waiting for this attempt (start + timeout_ms, Redis
    clock); ``expires_at`` is the task's own deadline (None when it has none). A task that has
    started runs to completion even past ``expires_at``: a handler that prefers to give up can
    compare it with the time and raise :class:`dtq_tasks.PermanentError`.
    """

    task_id: str
    idempotency_key: str | None
    attempt: int
    worker_id: str
    queue: str
    deadline: datetime
    expires_at: datetime | None = None
    task_type: str = ""
    max_attempts: int = 1


@dataclass(frozen=True)
class Handler:
    """One registered task type."""

    name: str
    fn: HandlerFn
    payload_model: type[BaseModel] | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)  # noqa: B004 - a callable object's method
        )

    def validate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The payload the handler receives: validated by ``payload_model`` when there is one
        (raises ``pydantic.ValidationError``), as a plain JSON dict."""
        if self.payload_model is None:
            return dict(payload)
        return self.payload_model.model_validate(dict(payload)).model_dump(mode="json")


_REGISTRY: dict[str, Handler] = {}


def task(name: str, *, payload_model: type[BaseModel] | None = None) -> Callable[[F], F]:
    """Register ``fn(payload: dict, ctx: TaskContext) -> JSON-serialisable`` as ``name``.

    ``async def`` handlers are awaited on the worker's event loop; plain functions run in a
    thread (GIL-bound: CPU-heavy work wants ``dtq worker run --processes N``). With
    ``payload_model`` (a pydantic model) the payload is validated before execution; an invalid
    payload is a permanent error and the handler is not called.
    """
    if not isinstance(name, str) or not TASK_TYPE_RE.fullmatch(name):
        raise TaskRegistrationError(
            f"task name {name!r} is invalid: 1-128 characters, letters, digits, '_', '.', ':', '-'"
        )
    if payload_model is not None and not (
        isinstance(payload_model, type) and issubclass(payload_model, BaseModel)
    ):
        raise TaskRegistrationError(
            f"payload_model of task {name!r} must be a pydantic BaseModel subclass"
        )

    def register(fn: F) -> F:
        if not callable(fn):
            raise TaskRegistrationError(f"task {name!r}: {fn!r} is not callable")
        old = _REGISTRY.get(name)
        if old is not None and _origin(old.fn) != _origin(fn):
            raise TaskRegistrationError(
                f"task {name!r} is already registered by {_origin(old.fn)}; "
                f"{_origin(fn)} cannot take the same name"
            )
        _REGISTRY[name] = Handler(name, fn, payload_model)
        return fn

    return register


def _origin(fn: Callable[..., Any]) -> str:
    """Where a handler is defined; a module reloaded (same place) may register again."""
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}"


def registry() -> Mapping[str, Handler]:
    """Every registered handler by name (a read-only view)."""
    return MappingProxyType(_REGISTRY)


def get_handler(name: str) -> Handler | None:
    """The handler registered as ``name``, or None."""
    return _REGISTRY.get(name)
