"""The handler registry: ``@task("name")`` and the context a handler receives (contract 15).

A worker executes only handlers registered here (contract section 13): the task_type of an entry
is looked up by name, never imported or evaluated. Registration happens when the task module is
imported; a second handler under a name that is taken is an error at that import.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Generic, NoReturn, ParamSpec, TypeVar, overload

from pydantic import BaseModel

from dtq.errors import InvalidTaskError
from dtq.limits import LimitDef
from dtq.models import QUEUE_RE, TASK_TYPE_RE, check_progress
from dtq.schedules import ScheduleDef
from dtq.workflows import ParentResult
from dtq_tasks.errors import RateLimited
from dtq_tasks.typed import AsyncTaskDef, SyncTaskDef, TaskDef

__all__ = [
    "Handler",
    "HandlerFn",
    "ProgressFn",
    "ScheduleDecl",
    "TaskContext",
    "TaskDecorator",
    "TaskRegistrationError",
    "code_limits",
    "code_schedules",
    "cron",
    "every",
    "get_handler",
    "registry",
    "task",
]

HandlerFn = Callable[[dict[str, Any], "TaskContext"], Any | Awaitable[Any]]
M = TypeVar("M", bound=BaseModel)
PayloadT = TypeVar("PayloadT")
R = TypeVar("R")
P = ParamSpec("P")
ProgressFn = Callable[["TaskContext", float | None, str], None]
"""What a worker gives a context to record progress with: (the context, the fraction, the
data's compact JSON), called from the handler's thread or the event loop's; never blocks."""


class TaskRegistrationError(ValueError):
    """A bad ``@task`` registration: invalid name, duplicate name, wrong payload_model."""


@dataclass(frozen=True)
class TaskContext:
    """What a handler knows about the execution it is part of.

    ``deadline`` is when the worker stops waiting for this attempt (start + timeout_ms, Redis
    clock); ``expires_at`` is the task's own deadline (None when it has none). A task that has
    started runs to completion even past ``expires_at``: a handler that prefers to give up can
    compare it with the time and raise :class:`dtq_tasks.PermanentError`.

    :meth:`progress` reports how far the handler is (docs/handlers.md, "Progress");
    :meth:`rate_limited` parks the task when an upstream pushes back (docs/limits.md).
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
    # A task a schedule fired (docs/schedules.md): the schedule's name and the tick it fired
    # for (a manual firing: when it was triggered). None for any other task.
    schedule: str | None = None
    scheduled_for: datetime | None = None
    # A node of a workflow (docs/workflows.md): the workflow's id, the node's name, and the end
    # of each of its parents by name (with its result when it succeeded). None and {} for any
    # other task.
    workflow_id: str | None = None
    node: str | None = None
    parent_results: Mapping[str, ParentResult] = field(default_factory=dict)
    # The worker's progress reporter; None (a context made by hand, a unit test): progress()
    # checks its arguments and records nothing.
    _progress: ProgressFn | None = field(default=None, repr=False, compare=False)

    def progress(self, fraction: float | None, data: Any = None) -> None:
        """Report how far this attempt is: ``fraction`` None (unknown) or from 0 to 1, and
        ``data`` any small JSON value (at most 4 KiB encoded:
        :data:`dtq.models.PROGRESS_DATA_MAX_BYTES`); else ValueError. A plain method, for async
        and sync handlers alike; it never blocks and costs almost nothing: the worker writes the
        first report at once, then at most one every 250 ms (the latest; the last one before
        the attempt's end), so it may be called as often as the handler likes."""
        checked, data_json = check_progress(fraction, data)
        if self._progress is not None:
            self._progress(self, checked, data_json)

    def rate_limited(self, retry_after_s: float, *, slow: bool = False) -> NoReturn:
        """Raise :class:`~dtq_tasks.RateLimited`: the task is parked for ``retry_after_s``
        seconds without spending an attempt, and with ``slow=True`` the limits it met are held
        as long (docs/limits.md, "Back-pressure from a handler"). For async and sync handlers
        alike; a bad argument raises ValueError instead."""
        raise RateLimited(retry_after_s, slow=slow)


@dataclass(frozen=True)
class Handler:
    """One registered task type."""

    name: str
    fn: HandlerFn
    payload_model: type[BaseModel] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.fn, TaskDef):  # a decorated handler: run the function itself
            object.__setattr__(self, "fn", self.fn.fn)

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
_SCHEDULES: dict[str, tuple[str, ScheduleDef]] = {}  # schedule name -> (task name, definition)
_LIMITS: dict[str, LimitDef] = {}  # task name -> the limit its @task declares


@dataclass(frozen=True)
class ScheduleDecl:
    """A schedule declared next to its handler (:func:`cron`, :func:`every`): the fields of a
    :class:`dtq.schedules.ScheduleDef` but the task type, which the decorator gives, and its
    name (by default the task's name, lowercased, each character a schedule name cannot hold
    turned into ``-``)."""

    fields: Mapping[str, Any]
    name: str | None = None


def cron(expr: str, tz: str = "UTC", *, name: str | None = None, **fields: Any) -> ScheduleDecl:
    """A cron schedule for ``@task(..., schedule=cron("0 7 * * *", tz="Europe/Paris"))``;
    ``fields``: the rest of a schedule's definition (payload, queue, priority, overlap,
    catchup, ttl_seconds, ...)."""
    return ScheduleDecl({**fields, "cron": expr, "tz": tz}, name)


def every(interval: int | str, *, name: str | None = None, **fields: Any) -> ScheduleDecl:
    """An interval schedule (``every("5m")``, ``every(30)``) for ``@task(..., schedule=...)``."""
    return ScheduleDecl({**fields, "every": interval}, name)


def _schedule_name(task_name: str) -> str:
    name = "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "-" for c in task_name)
    return name.lower().lstrip("_-")[:64] or "schedule"


def _declare(task_name: str, decls: ScheduleDecl | Sequence[ScheduleDecl]) -> None:
    items = [decls] if isinstance(decls, ScheduleDecl) else list(decls)
    for decl in items:
        if not isinstance(decl, ScheduleDecl):
            raise TaskRegistrationError(
                f"task {task_name!r}: schedule= takes cron(...) or every(...), not {decl!r}"
            )
        name = decl.name or _schedule_name(task_name)
        if not QUEUE_RE.fullmatch(name):
            raise TaskRegistrationError(
                f"task {task_name!r}: schedule name {name!r} is invalid: 1 to 64 of a-z, 0-9, "
                "'_' and '-'"
            )
        try:
            d = ScheduleDef.parse({**decl.fields, "task_type": task_name})
        except InvalidTaskError as exc:
            raise TaskRegistrationError(f"task {task_name!r}: schedule {name!r}: {exc}") from None
        old = _SCHEDULES.get(name)
        if old is not None and old[0] != task_name:
            raise TaskRegistrationError(
                f"schedule {name!r} is already declared by task {old[0]!r}; give one a name="
            )
        _SCHEDULES[name] = (task_name, d)


def code_schedules() -> Mapping[str, ScheduleDef]:
    """Every schedule declared with ``@task(..., schedule=...)``, by schedule name."""
    return MappingProxyType({name: d for name, (_, d) in _SCHEDULES.items()})


def code_limits() -> Mapping[str, LimitDef]:
    """Every limit declared with ``@task(..., rate_limit=..., concurrency=...)``, by limit name
    (the task's name)."""
    return MappingProxyType(dict(_LIMITS))


def _limit(
    task_name: str,
    rate_limit: str | None,
    concurrency: int | None,
    limit_key: str | None,
    limit_burst: int | None,
    limit_queue: str,
) -> LimitDef | None:
    """The limit ``@task`` declares (None: none); TaskRegistrationError when it is invalid."""
    if rate_limit is None and concurrency is None:
        if limit_key is not None or limit_burst is not None:
            raise TaskRegistrationError(
                f"task {task_name!r}: limit_key and limit_burst need rate_limit or concurrency"
            )
        return None
    fields = {"queue": limit_queue, "task_type": task_name, "key": limit_key,
              "rate": rate_limit, "burst": limit_burst, "concurrency": concurrency}  # fmt: skip
    try:
        return LimitDef.parse({**fields, "source": "code"})
    except InvalidTaskError as exc:
        raise TaskRegistrationError(f"task {task_name!r}: {exc}") from None


class TaskDecorator(Generic[PayloadT]):
    """What ``task(name, ...)`` returns: applied to a handler, it registers it and gives back
    its :class:`dtq_tasks.typed.TaskDef` (an :class:`AsyncTaskDef` for an ``async def``
    handler, a :class:`SyncTaskDef` for a plain function), typed by the handler's parameters
    and return annotation."""

    def __init__(
        self,
        name: str,
        payload_model: type[BaseModel] | None,
        schedule: ScheduleDecl | Sequence[ScheduleDecl] | None,
        limit: LimitDef | None = None,
    ) -> None:
        self.name = name
        self.payload_model = payload_model
        self.schedule = schedule
        self.limit = limit

    # An async handler matches both signatures (in the second, R is its coroutine), which
    # mypy flags as an overlap; overloads are tried in order, so it gets the first.
    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, fn: Callable[P, Coroutine[Any, Any, R]], /
    ) -> AsyncTaskDef[PayloadT, R, P]: ...

    @overload
    def __call__(self, fn: Callable[P, R], /) -> SyncTaskDef[PayloadT, R, P]: ...

    def __call__(self, fn: Callable[..., Any], /) -> TaskDef[Any, Any]:
        name = self.name
        if isinstance(fn, TaskDef):  # a definition registered again (a module reloaded)
            fn = fn.fn
        if not callable(fn):
            raise TaskRegistrationError(f"task {name!r}: {fn!r} is not callable")
        old = _REGISTRY.get(name)
        if old is not None and _origin(old.fn) != _origin(fn):
            raise TaskRegistrationError(
                f"task {name!r} is already registered by {_origin(old.fn)}; "
                f"{_origin(fn)} cannot take the same name"
            )
        if self.schedule is not None:
            _declare(name, self.schedule)
        if self.limit is not None:
            _LIMITS[name] = self.limit
        else:
            _LIMITS.pop(name, None)  # a module reloaded without its limit
        handler = _REGISTRY[name] = Handler(name, fn, self.payload_model)
        kind = AsyncTaskDef if handler.is_async else SyncTaskDef
        return kind(name, fn, self.payload_model)


@overload
def task(
    name: str,
    *,
    payload_model: None = None,
    schedule: ScheduleDecl | Sequence[ScheduleDecl] | None = None,
    rate_limit: str | None = None,
    concurrency: int | None = None,
    limit_key: str | None = None,
    limit_burst: int | None = None,
    limit_queue: str = "default",
) -> TaskDecorator[Mapping[str, Any]]: ...


@overload
def task(
    name: str,
    *,
    payload_model: type[M],
    schedule: ScheduleDecl | Sequence[ScheduleDecl] | None = None,
    rate_limit: str | None = None,
    concurrency: int | None = None,
    limit_key: str | None = None,
    limit_burst: int | None = None,
    limit_queue: str = "default",
) -> TaskDecorator[M]: ...


def task(
    name: str,
    *,
    payload_model: type[BaseModel] | None = None,
    schedule: ScheduleDecl | Sequence[ScheduleDecl] | None = None,
    rate_limit: str | None = None,
    concurrency: int | None = None,
    limit_key: str | None = None,
    limit_burst: int | None = None,
    limit_queue: str = "default",
) -> TaskDecorator[Any]:
    """Register ``fn(payload: dict, ctx: TaskContext) -> JSON-serialisable`` as ``name``.

    ``async def`` handlers are awaited on the worker's event loop; plain functions run in a
    thread (GIL-bound: CPU-heavy work wants ``dtq worker run --processes N``). With
    ``payload_model`` (a pydantic model) the payload is validated before execution; an invalid
    payload is a permanent error and the handler is not called. The handler still receives a
    dict (the validated model as JSON).

    ``schedule``: one or more periodic schedules of this task (:func:`cron`, :func:`every`),
    created or updated in Redis when a worker with this handler starts (docs/schedules.md,
    "Schedules in code").

    ``rate_limit`` (``"100/s"``, ``"5/m"``, ``"10/30s"``, with ``limit_burst`` tasks at once
    at most) and ``concurrency`` (RUNNING tasks at most) declare a limit named after the task,
    on this task type in ``limit_queue``, per value of the payload's ``limit_key``
    (``"payload.tenant_id"``) when given: created or updated in Redis when a worker with this
    handler starts, deleted when the code no longer declares it (docs/limits.md).

    The decorated name is a typed definition that calls the handler when called and submits
    the task with its payload typed: ``await fn.submit(q, payload, **options)`` returns a
    :class:`dtq_tasks.typed.TaskHandle` whose ``result()`` has the handler's return type
    (docs/sdk.md, "Typed task handles").
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
    limit = _limit(name, rate_limit, concurrency, limit_key, limit_burst, limit_queue)
    return TaskDecorator(name, payload_model, schedule, limit)


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
