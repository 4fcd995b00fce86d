"""Every Redis key and channel name dtq uses; nowhere else writes ``"dtq:"``.

The names are the contract's (section 2) plus the deliberate extensions of DESIGN 6 and 7, and
the payload key of tasks an older dtq wrote; ``docs/redis-schema.md`` describes each one.
"""

from __future__ import annotations

__all__ = [
    "AUDIT",
    "CANCELLED",
    "CONSUMER_GROUP",
    "DEAD_LETTER",
    "EVENTS",
    "EXPIRY",
    "PREFIX",
    "PRIORITIES",
    "QUEUES",
    "RECENT",
    "RETRY_CLAIMED",
    "RETRY_SCHEDULE",
    "SCHEDULER_LOCK",
    "TASK_MATCH",
    "WORKERS",
    "history",
    "idempotency",
    "operation",
    "payload",
    "queue_last_submit",
    "queue_paused",
    "queue_streams",
    "result",
    "stream",
    "stream_queue",
    "task",
    "task_id_of",
    "worker",
]

PREFIX = "dtq:"
CONSUMER_GROUP = "workers"
PRIORITIES = tuple(range(9, -1, -1))  # strict order of reading: p9 first

DEAD_LETTER = "dtq:stream:dead-letter"
AUDIT = "dtq:stream:audit"
RETRY_SCHEDULE = "dtq:retry:schedule"
RETRY_CLAIMED = "dtq:retry:claimed"
WORKERS = "dtq:workers"
CANCELLED = "dtq:cancelled"
RECENT = "dtq:tasks:recent"
SCHEDULER_LOCK = "dtq:lock:scheduler"
EXPIRY = "dtq:expiry"  # deliberate extension (DESIGN 6)
EVENTS = "dtq:events"  # pub/sub channel, not a key
QUEUES = "dtq:queues"  # deliberate extension: set of the queue names in use (DESIGN 11)


def stream(queue: str, priority: int) -> str:
    return f"dtq:stream:{queue}:p{priority}"


def queue_streams(queue: str) -> list[str]:
    """The queue's ten streams, p9 first (the order workers read them in)."""
    return [f"dtq:stream:{queue}:p{p}" for p in PRIORITIES]


def stream_queue(stream_key: str) -> tuple[str, int]:
    """Inverse of :func:`stream`: ``dtq:stream:<queue>:p<N>`` -> (queue, N)."""
    _, _, queue, band = stream_key.split(":")
    return queue, int(band[1:])


def task(task_id: str) -> str:
    return f"dtq:task:{task_id}"


TASK_MATCH = "dtq:task:*"
"""SCAN pattern of the task hashes (with ``TYPE hash``: a task's history and an older dtq's
payload key match it too)."""


def task_id_of(task_key: str) -> str:
    """Inverse of :func:`task`: ``dtq:task:<task_id>`` -> the task id."""
    return task_key[len("dtq:task:") :]


def history(task_id: str) -> str:
    return f"dtq:task:{task_id}:history"


def payload(task_id: str) -> str:
    """Where the dtq before this one kept a task's payload JSON, beside its hash. Nothing
    writes it now (the payload is the hash's ``payload`` field, contract section 2): the
    scripts that give a task a lifetime receive it to move such a key into the hash, and reads
    fall back to it for a task not moved yet (docs/redis-schema.md, "Tasks an older dtq
    wrote")."""
    return f"dtq:task:{task_id}:payload"


def result(task_id: str) -> str:
    return f"dtq:result:{task_id}"


def idempotency(queue: str, key: str | None) -> str:
    """The idempotency record's key; a task without a key gets a placeholder never written."""
    return f"dtq:idempotency:{queue}:{key}" if key else "dtq:idempotency:-"


def operation(key: str) -> str:
    """The record of one handler-level operation (``dtq_tasks.idempotent_operation``)."""
    return f"dtq:op:{key}"


def worker(worker_id: str) -> str:
    return f"dtq:worker:{worker_id}"


def queue_paused(queue: str) -> str:
    return f"dtq:queue:{queue}:paused"


def queue_last_submit(queue: str) -> str:
    """The Redis time (epoch ms) of the queue's last submit: written by submit.lua, read and
    deleted by remove_queue.lua (docs/redis-schema.md, "Queue lifetime")."""
    return f"dtq:queue:{queue}:last_submit"
