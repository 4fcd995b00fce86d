"""The handler contract of dtq (contract section 15).

::

    from dtq_tasks import PermanentError, RetryableError, TaskContext, task

    @task("resize_image")
    async def resize_image(payload: dict, ctx: TaskContext) -> dict:
        ...
        return {"ok": True}

Handlers receive the payload (a dict) and a :class:`TaskContext`; they return something JSON
can encode (or a pydantic model), or raise :class:`RetryableError`, :class:`PermanentError`,
:class:`RescheduleError` or :class:`RateLimited`. ``@task`` gives back a :class:`TaskDef`:
still callable as the handler, it also submits itself, its payload and result typed
(:mod:`dtq_tasks.typed`).
This package imports nothing of ``dtq.worker`` or ``dtq.api``.
"""

from dtq_tasks.errors import (
    HandlerError,
    PermanentError,
    RateLimited,
    RescheduleError,
    RetryableError,
    TaskCancelled,
    TimeLimitExceeded,
)
from dtq_tasks.idempotency import idempotent_operation
from dtq_tasks.modules import TaskModules, load_task_modules, load_task_types
from dtq_tasks.registry import (
    Handler,
    HandlerFn,
    ScheduleDecl,
    TaskContext,
    TaskDecorator,
    TaskRegistrationError,
    code_limits,
    code_schedules,
    cron,
    every,
    get_handler,
    registry,
    task,
)
from dtq_tasks.typed import AsyncTaskDef, SyncTaskDef, SyncTaskHandle, TaskDef, TaskHandle

__all__ = [
    "AsyncTaskDef",
    "Handler",
    "HandlerError",
    "HandlerFn",
    "PermanentError",
    "RateLimited",
    "RescheduleError",
    "RetryableError",
    "ScheduleDecl",
    "SyncTaskDef",
    "SyncTaskHandle",
    "TaskCancelled",
    "TaskContext",
    "TaskDecorator",
    "TaskDef",
    "TaskHandle",
    "TaskModules",
    "TaskRegistrationError",
    "TimeLimitExceeded",
    "code_limits",
    "code_schedules",
    "cron",
    "every",
    "get_handler",
    "idempotent_operation",
    "load_task_modules",
    "load_task_types",
    "registry",
    "task",
]
