"""Every error dtq raises on purpose.

The tree is shallow; the API and the CLI map each leaf to one error code (``code``)::

    DtqError
    ├── ConfigError                   invalid DTQ_* setting            (CLI exit 2)
    ├── InvalidTaskError              INVALID_TASK         400         (CLI exit 2)
    │   ├── UnknownTaskTypeError      UNKNOWN_TASK_TYPE    400
    │   ├── PayloadTooLargeError      PAYLOAD_TOO_LARGE    413
    │   ├── ScheduleSpecError         INVALID_SCHEDULE     400
    │   └── LimitSpecError            INVALID_LIMIT        400  (in dtq.limits)
    ├── QueueFullError                QUEUE_FULL           429 + Retry-After
    ├── IdempotencyInProgressError    IDEMPOTENCY_IN_PROGRESS 409
    ├── TaskNotFoundError             TASK_NOT_FOUND       404
    │   └── ResultExpired             RESULT_EXPIRED       404  (the result key's lifetime ran out)
    ├── ScheduleNotFoundError         SCHEDULE_NOT_FOUND   404
    ├── ScheduleExistsError           SCHEDULE_EXISTS      409
    ├── LimitNotFoundError            LIMIT_NOT_FOUND      404
    ├── InvalidTransitionError        INVALID_TRANSITION   409
    │   ├── TaskRunningError          TASK_RUNNING         409  (cancel requested)
    │   └── TaskTerminalError         TASK_TERMINAL        410
    ├── NotInDeadLetterError          NOT_IN_DLQ           404
    ├── WorkerNotFoundError           WORKER_NOT_FOUND     404
    ├── ReplicationTimeoutError       REPLICATION_TIMEOUT  503         (CLI exit 1)
    └── RedisUnavailableError         REDIS_UNAVAILABLE    503         (CLI exit 1)

Handler-side errors (``RetryableError``, ``PermanentError``, ``RescheduleError``) are part of
the handler contract and live in :mod:`dtq_tasks`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigError",
    "DtqError",
    "IdempotencyInProgressError",
    "InvalidTaskError",
    "InvalidTransitionError",
    "InvalidWorkflowError",
    "LimitNotFoundError",
    "NotInDeadLetterError",
    "PayloadTooLargeError",
    "QueueFullError",
    "RedisUnavailableError",
    "ReplicationTimeoutError",
    "ResultExpired",
    "ScheduleExistsError",
    "ScheduleNotFoundError",
    "ScheduleSpecError",
    "TaskCancelled",
    "TaskEnded",
    "TaskExpired",
    "TaskFailed",
    "TaskNotFoundError",
    "TaskRunningError",
    "TaskTerminalError",
    "UnknownTaskTypeError",
    "WaitTimeout",
    "WorkerNotFoundError",
    "WorkflowNotFoundError",
]


class DtqError(Exception):
    """Root of every dtq error. ``code`` is the stable error code the API and CLI show."""

    code = "DTQ_ERROR"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details


class ConfigError(DtqError):
    code = "CONFIG_ERROR"


class InvalidTaskError(DtqError):
    code = "INVALID_TASK"


class UnknownTaskTypeError(InvalidTaskError):
    code = "UNKNOWN_TASK_TYPE"


class PayloadTooLargeError(InvalidTaskError):
    code = "PAYLOAD_TOO_LARGE"


class ScheduleSpecError(InvalidTaskError):
    """A schedule's spec is not valid: ``field`` names the offending field ("cron", "tz",
    "every", ...); the message says what is wrong and what is allowed."""

    code = "INVALID_SCHEDULE"

    def __init__(self, message: str, *, field: str, **details: Any) -> None:
        super().__init__(message, field=field, **details)
        self.field = field


class QueueFullError(DtqError):
    """The queue's depth reached DTQ_MAX_QUEUE_DEPTH. ``retry_after_s`` is a hint for callers."""

    code = "QUEUE_FULL"

    def __init__(self, message: str, *, retry_after_s: int = 1, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class IdempotencyInProgressError(DtqError):
    code = "IDEMPOTENCY_IN_PROGRESS"


class ScheduleNotFoundError(DtqError):
    code = "SCHEDULE_NOT_FOUND"


class ScheduleExistsError(DtqError):
    """A create-only put found a schedule of that name."""

    code = "SCHEDULE_EXISTS"


class LimitNotFoundError(DtqError):
    """No rate or concurrency limit of that name (docs/limits.md)."""

    code = "LIMIT_NOT_FOUND"


class TaskNotFoundError(DtqError):
    code = "TASK_NOT_FOUND"


class InvalidWorkflowError(DtqError):
    """A workflow that cannot run as given (docs/workflows.md): no node, a name given twice,
    a dependency on an unknown node or on itself, a cycle, or a node whose task is invalid."""

    code = "INVALID_WORKFLOW"


class WorkflowNotFoundError(DtqError):
    """No workflow has this id, or it ended more than its retention ago."""

    code = "WORKFLOW_NOT_FOUND"


class ResultExpired(TaskNotFoundError):
    """The task succeeded with a result, and the result's key outlived its retention
    (``DTQ_RESULT_RETENTION_S``) while the task's hash did not."""

    code = "RESULT_EXPIRED"


class InvalidTransitionError(DtqError):
    """The task's current status does not allow the operation; ``details['status']`` names it."""

    code = "INVALID_TRANSITION"


class TaskRunningError(InvalidTransitionError):
    """Cancel of a running task: cancellation was requested, the worker stops it."""

    code = "TASK_RUNNING"


class TaskTerminalError(InvalidTransitionError):
    code = "TASK_TERMINAL"


class NotInDeadLetterError(DtqError):
    code = "NOT_IN_DLQ"


class WorkerNotFoundError(DtqError):
    code = "WORKER_NOT_FOUND"


class ReplicationTimeoutError(DtqError):
    """The primary accepted the submit, but fewer than ``DTQ_SUBMIT_MIN_REPLICAS`` replicas
    confirmed it within ``DTQ_SUBMIT_REPLICA_TIMEOUT_MS``. Nothing is rolled back: the task
    exists and may run. ``task_id`` names it; ``duplicate`` is True when the submit was a replay
    of an idempotency key whose task already existed (nothing new was written). ``task`` is the
    task the submit would have answered with (None for a replay of a task still in progress).
    A retry with the same idempotency key is safe (docs/delivery-guarantees.md)."""

    code = "REPLICATION_TIMEOUT"

    def __init__(
        self,
        message: str,
        *,
        task_id: str,
        duplicate: bool,
        task: Any = None,
        **details: Any,
    ) -> None:
        super().__init__(message, task_id=task_id, duplicate=duplicate, **details)
        self.task_id = task_id
        self.duplicate = duplicate
        self.task = task


class RedisUnavailableError(DtqError):
    code = "REDIS_UNAVAILABLE"


# -- the ends of a wait (Queue.wait, Queue.result; docs/sdk.md "Waiting for a task") ----------
# ``task`` is a dtq.models.Task (this module sits below the models and names none of them).


class WaitTimeout(DtqError):
    """The wait's timeout passed before the task (every task of a wait_many) ended.
    ``pending``: the ids still going; ``task``: the first of them as last read (None when
    Redis did not answer); ``tasks``: those read."""

    code = "WAIT_TIMEOUT"

    def __init__(self, message: str, *, pending: list[str], tasks: list[Any]) -> None:
        super().__init__(message, task_id=pending[0] if pending else None, pending=pending)
        self.pending = pending
        self.tasks = tasks
        self.task_id = pending[0] if pending else None
        self.task: Any = next((t for t in tasks if t.task_id == self.task_id), None)

    @classmethod
    def of(cls, pending: list[str], tasks: list[Any]) -> WaitTimeout:
        what = f"task {pending[0]}" if len(pending) == 1 else f"{len(pending)} tasks"
        return cls(f"timed out waiting for {what} to end", pending=pending, tasks=tasks)


class TaskEnded(DtqError):
    """A waited task ended without a result; ``task`` is the task as it ended. Its leaves
    carry the codes; this base is what ``except`` catches for all three."""

    code = "TASK_ENDED"

    def __init__(self, message: str, *, task: Any) -> None:
        super().__init__(message, task_id=task.task_id, status=str(task.status))
        self.task = task
        self.task_id: str = task.task_id


class TaskFailed(TaskEnded):
    """The task failed or was dead-lettered: ``error_class`` and ``error_message`` are the
    last attempt's."""

    code = "TASK_FAILED"

    def __init__(self, message: str, *, task: Any) -> None:
        super().__init__(message, task=task)
        self.error_class: str | None = task.error_class
        self.error_message: str | None = task.error_message
        self.details.update(error_class=self.error_class, error_message=self.error_message)

    @classmethod
    def of(cls, task: Any) -> TaskFailed:
        why = f"{task.error_class}: {task.error_message}" if task.error_class else "no error"
        return cls(f"task {task.task_id} {task.status} at attempt {task.attempt}: {why}", task=task)


class TaskCancelled(TaskEnded):
    code = "TASK_CANCELLED"


class TaskExpired(TaskEnded):
    code = "TASK_EXPIRED"
