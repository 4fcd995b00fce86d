"""dtq: a distributed task queue for Python on Redis Streams."""

from dtq.client import Audit, Queue, SyncQueue, connect, connect_sync
from dtq.config import Settings, load_settings
from dtq.errors import (
    DtqError,
    ResultExpired,
    TaskCancelled,
    TaskEnded,
    TaskExpired,
    TaskFailed,
    TaskNotFoundError,
    WaitTimeout,
)
from dtq.models import HistoryEntry, Task, TaskStatus
from dtq.workflows import Workflow, WorkflowSpec, chain, chord, group, node
from dtq_tasks.errors import RateLimited  # the handler contract's one re-export (docs/limits.md)

# The name the waiting API's documentation uses for an unknown or expired task id.
TaskNotFound = TaskNotFoundError

__all__ = [
    "Audit",
    "DtqError",
    "HistoryEntry",
    "Queue",
    "RateLimited",
    "ResultExpired",
    "Settings",
    "SyncQueue",
    "Task",
    "TaskCancelled",
    "TaskEnded",
    "TaskExpired",
    "TaskFailed",
    "TaskNotFound",
    "TaskNotFoundError",
    "TaskStatus",
    "WaitTimeout",
    "Workflow",
    "WorkflowSpec",
    "chain",
    "chord",
    "connect",
    "connect_sync",
    "group",
    "load_settings",
    "node",
]
__version__ = "0.1.0"
