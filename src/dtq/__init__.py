"""dtq: a distributed task queue for Python on Redis Streams."""

from dtq.client import Audit, Queue, SyncQueue, connect, connect_sync
from dtq.config import Settings, load_settings
from dtq.errors import DtqError
from dtq.models import HistoryEntry, Task, TaskStatus

__all__ = [
    "Audit",
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
]
__version__ = "0.1.0"
