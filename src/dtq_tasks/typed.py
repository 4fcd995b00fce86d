"""Typed task definitions and handles: what ``@task`` gives back (docs/sdk.md, "Typed task
handles").

::

    class Resize(BaseModel):
        url: str
        width: int

    @task("resize", payload_model=Resize)
    async def resize(payload: dict[str, Any], ctx: TaskContext) -> Thumb:
        ...

    handle = await resize.submit(q, Resize(url="https://...", width=64), priority=7)
    thumb = await handle.result(timeout=30)      # a Thumb, for mypy and at run time

A definition is still the handler: calling it calls the function, and the worker runs the
function that ``@task`` registered. Its payload type is the ``payload_model`` (an instance of
it; :meth:`TaskDef.submit_fields` takes its fields, checked at run time) or, without one, a
JSON object (``Mapping[str, Any]``). The options are :class:`dtq.models.SubmitOptions`, checked
by :meth:`dtq.Queue.submit` as for any submission.

A handle's :meth:`TaskHandle.result` is typed by the handler's return annotation and, at run
time, is the stored JSON result validated into that type with pydantic (so ``-> Thumb``, a
pydantic model, gives a ``Thumb``; ``-> tuple[int, int]`` a tuple). An annotation that is
missing, ``Any``, or cannot be resolved at run time (a name imported only under
``TYPE_CHECKING``) gives the JSON value as it is.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Generic, ParamSpec, TypeVar, Unpack

from pydantic import BaseModel, TypeAdapter

from dtq import workflows
from dtq.client import Queue, SyncQueue
from dtq.errors import InvalidTaskError
from dtq.models import SubmitOptions, Task, validate_payload
from dtq.waits import DEFAULT_WAIT_S
from dtq.workflows import Shape

__all__ = ["AsyncTaskDef", "SyncTaskDef", "SyncTaskHandle", "TaskDef", "TaskHandle"]

PayloadT = TypeVar("PayloadT")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
P = ParamSpec("P")

_UNSET: Any = object()


Q = TypeVar("Q", Queue, SyncQueue)


class _Handle(Generic[Q, R_co]):
    """What both handles hold: the queue, the submitted task, the result's conversion."""

    def __init__(self, queue: Q, task: Task, result_of: Callable[[Any], R_co]) -> None:
        self.queue: Q = queue
        self.task = task
        self._result_of = result_of

    @property
    def task_id(self) -> str:
        return self.task.task_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.task.task_type!r}, {self.task.task_id!r})"


class TaskHandle(_Handle[Queue, R_co]):
    """One task submitted through its definition: the :class:`dtq.models.Task` the submit
    returned, and waits typed by the handler's return annotation."""

    # ``timeout`` is the wait's own deadline, as in Queue.wait (not a cancellation scope).
    async def wait(self, *, timeout: float = DEFAULT_WAIT_S) -> Task:  # noqa: ASYNC109
        """The task once terminal (:meth:`dtq.Queue.wait`)."""
        return await self.queue.wait(self.task.task_id, timeout=timeout)

    async def result(self, *, timeout: float = DEFAULT_WAIT_S) -> R_co:  # noqa: ASYNC109
        """The handler's result as its return type (:meth:`dtq.Queue.result` raises for a
        task that did not succeed)."""
        return self._result_of(await self.queue.result(self.task.task_id, timeout=timeout))


class SyncTaskHandle(_Handle[SyncQueue, R_co]):
    """:class:`TaskHandle` for a :class:`dtq.SyncQueue`: the same waits, blocking."""

    def wait(self, *, timeout: float = DEFAULT_WAIT_S) -> Task:
        return self.queue.wait(self.task.task_id, timeout=timeout)

    def result(self, *, timeout: float = DEFAULT_WAIT_S) -> R_co:
        return self._result_of(self.queue.result(self.task.task_id, timeout=timeout))


class TaskDef(Generic[PayloadT, R]):
    """A registered task type that submits itself: ``PayloadT`` is what :meth:`submit` takes
    (the payload model, else a JSON object), ``R`` the handler's return type. ``@task`` builds
    :class:`AsyncTaskDef` or :class:`SyncTaskDef`, which are also callable as the handler."""

    def __init__(
        self, name: str, fn: Callable[..., Any], payload_model: type[BaseModel] | None
    ) -> None:
        functools.update_wrapper(typing.cast(Any, self), fn)  # name, doc, __wrapped__
        self.name = name
        self.fn = fn
        self.payload_model = payload_model
        self._adapter: TypeAdapter[Any] | None = _UNSET

    async def submit(
        self, q: Queue, payload: PayloadT | None = None, /, **options: Unpack[SubmitOptions]
    ) -> TaskHandle[R]:
        """Submit one task of this type (``q.submit(name, payload, **options)``)."""
        task = await q.submit(self.name, self._payload(payload), **options)
        return TaskHandle(q, task, self.result_of)

    async def submit_fields(
        self,
        q: Queue,
        fields: Mapping[str, Any] | None = None,
        /,
        **options: Unpack[SubmitOptions],
    ) -> TaskHandle[R]:
        """Submit one task given its payload's fields, validated by the payload model here
        (INVALID_TASK naming each refused field) rather than by mypy."""
        task = await q.submit(self.name, self._fields(fields), **options)
        return TaskHandle(q, task, self.result_of)

    def submit_sync(
        self, q: SyncQueue, payload: PayloadT | None = None, /, **options: Unpack[SubmitOptions]
    ) -> SyncTaskHandle[R]:
        """:meth:`submit` through a :class:`dtq.SyncQueue`."""
        task = q.submit(self.name, self._payload(payload), **options)
        return SyncTaskHandle(q, task, self.result_of)

    def submit_fields_sync(
        self,
        q: SyncQueue,
        fields: Mapping[str, Any] | None = None,
        /,
        **options: Unpack[SubmitOptions],
    ) -> SyncTaskHandle[R]:
        """:meth:`submit_fields` through a :class:`dtq.SyncQueue`."""
        task = q.submit(self.name, self._fields(fields), **options)
        return SyncTaskHandle(q, task, self.result_of)

    def node(self, name: str, payload: PayloadT | None = None, /, **options: Any) -> Shape:
        """A workflow node of this type (:func:`dtq.workflows.node`), its payload typed like
        :meth:`submit`'s; compose it with ``chain``/``group``/``chord`` and submit the shape
        with ``Queue.submit_workflow``. A node reads its typed parents' results with
        ``handle.result_of(ctx.parent_results[name].result)``."""
        return workflows.node(name, self.name, self._payload(payload), **options)

    def result_of(self, value: Any) -> R:
        """A stored JSON result as the handler's return type (see the module's docstring);
        a result that does not fit it raises ``pydantic.ValidationError``."""
        adapter = self._adapter
        if adapter is _UNSET:
            adapter = self._adapter = _result_adapter(self.fn)
        if adapter is None:
            return typing.cast(R, value)
        return typing.cast(R, adapter.validate_python(value))

    def _payload(self, payload: object) -> Mapping[str, Any] | None:
        model = self.payload_model
        if model is None or payload is None:
            return self._fields(typing.cast("Mapping[str, Any] | None", payload))
        if not isinstance(payload, model):
            raise InvalidTaskError(
                f"task {self.name!r} takes a {model.__name__} payload, not "
                f"{type(payload).__name__} (submit_fields takes its fields)",
                task_type=self.name,
                field="payload",
            )
        return payload.model_dump(mode="json", by_alias=True)

    def _fields(self, fields: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        model = self.payload_model
        if model is None:
            return fields
        value = validate_payload(model, {} if fields is None else fields, self.name)
        return value.model_dump(mode="json", by_alias=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.fn!r})"


class AsyncTaskDef(TaskDef[PayloadT, R], Generic[PayloadT, R, P]):
    """The definition of an ``async def`` handler; calling it calls the handler."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        coro: Coroutine[Any, Any, R] = self.fn(*args, **kwargs)
        return coro


class SyncTaskDef(TaskDef[PayloadT, R], Generic[PayloadT, R, P]):
    """The definition of a plain-function handler; calling it calls the handler."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = self.fn(*args, **kwargs)
        return result


def _result_adapter(fn: Callable[..., Any]) -> TypeAdapter[Any] | None:
    """A validator for ``fn``'s return annotation; None when there is nothing to validate
    (none, ``Any``) or it cannot be resolved or turned into a pydantic schema."""
    target = fn if inspect.isroutine(fn) else type(fn).__call__  # a callable object's method
    try:
        returns = typing.get_type_hints(target).get("return", Any)
    except Exception:  # a name that exists only for type checkers
        return None
    if returns is Any:
        return None
    try:
        return TypeAdapter(returns)
    except Exception:  # a type pydantic cannot validate
        return None
