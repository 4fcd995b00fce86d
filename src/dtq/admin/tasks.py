"""Cancel and expire one task (one script call each), and the scheduler's expiry sweep (batches
of due tasks, several tasks per ``expire.lua`` call)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from dtq import keys
from dtq.admin._common import SWEEP_BATCH, SWEEP_PER_CALL, Audit, audit_args
from dtq.errors import (
    InvalidTransitionError,
    TaskNotFoundError,
    TaskRunningError,
    TaskTerminalError,
)
from dtq.models import TaskStatus
from dtq.scripts import Call
from dtq.store import Store, new_id

__all__ = ["Swept", "cancel", "expire", "sweep_due", "sweep_expired", "task_keys"]

Where = tuple[str, int, str]
"""(queue, priority, idempotency_key) of a task: what decides its stream and record keys."""


async def task_keys(store: Store, task_ids: Sequence[str]) -> list[Where | None]:
    """(queue, priority, idempotency_key) of each task, None where the hash is gone."""
    pipe = store.redis.pipeline(transaction=False)
    for tid in task_ids:
        pipe.hmget(keys.task(tid), "queue", "priority", "idempotency_key")
    out: list[Where | None] = []
    for q, p, k in await pipe.execute():
        out.append(None if q is None else (q, int(p), k or ""))
    return out


def _cancel_call(
    store: Store, task_id: str, where: tuple[str, int, str], reason: str, audit: Audit | None
) -> Call:
    queue, priority, idem = where
    s = store.settings
    return (
        "cancel",
        [
            keys.task(task_id),
            keys.history(task_id),
            keys.RETRY_SCHEDULE,
            keys.RETRY_CLAIMED,
            keys.EXPIRY,
            keys.stream(queue, priority),
            keys.CANCELLED,
            keys.idempotency(queue, idem),
            keys.AUDIT,
            keys.payload(task_id),
        ],
        [
            task_id,
            s.task_retention_s,
            s.idem_ttl_s,
            keys.EVENTS,
            new_id(),
            reason,
            *audit_args(audit),
        ],
    )


async def cancel(
    store: Store, task_id: str, *, reason: str = "cancel", audit: Audit | None = None
) -> str:
    """Cancel a task; returns the status it was cancelled from.

    Raises TaskRunningError (cancellation requested: audited, as it is a change),
    TaskTerminalError, TaskNotFoundError.
    """
    where = (await task_keys(store, [task_id]))[0]
    if where is None:
        raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    call = _cancel_call(store, task_id, where, reason, audit)
    return _cancel_reply(task_id, await store.scripts.call(store.redis, *call))


def _cancel_reply(task_id: str, reply: list[Any]) -> str:
    kind = reply[0]
    if kind == "cancelled":
        return str(reply[1])
    if kind == "requested":
        raise TaskRunningError(
            f"task {task_id} is running: cancellation requested, the worker stops it",
            task_id=task_id,
            status=TaskStatus.RUNNING.value,
        )
    if reply[1] == "NOT_FOUND":
        raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    raise TaskTerminalError(
        f"task {task_id} is already {reply[2]}: a finished task cannot be cancelled",
        task_id=task_id,
        status=reply[2],
    )


def _expire_call(
    store: Store, tasks: Sequence[tuple[str, Where | None]], mode: str, audit: Audit | None
) -> Call:
    """One ``expire.lua`` call for ``tasks`` ((task_id, where) pairs). A task whose ``where``
    is not known yet gets its hash, history and payload keys only (see the script's header)."""
    s = store.settings
    key_list = [keys.RETRY_SCHEDULE, keys.RETRY_CLAIMED, keys.EXPIRY, keys.AUDIT]
    argv: list[Any] = [mode, s.task_retention_s, s.idem_ttl_s, keys.EVENTS, *audit_args(audit)]
    for task_id, where in tasks:
        key_list += [keys.task(task_id), keys.history(task_id), keys.payload(task_id)]
        if where is None:
            argv += [task_id, new_id(), 3]
        else:
            queue, priority, idem = where
            key_list += [keys.stream(queue, priority), keys.idempotency(queue, idem)]
            argv += [task_id, new_id(), 5]
    return ("expire", key_list, argv)


async def expire(store: Store, task_id: str, *, audit: Audit | None = None) -> str:
    """Mark a not-started task EXPIRED now; returns the status it expired from."""
    where = (await task_keys(store, [task_id]))[0]
    if where is None:
        raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    call = _expire_call(store, [(task_id, where)], "manual", audit)
    (reply,) = await store.scripts.call(store.redis, *call)
    if reply[0] == "expired":
        return str(reply[1])
    if reply[1] == "NOT_FOUND":
        raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    status = reply[2]
    raise InvalidTransitionError(
        f"task {task_id} is {status}: only a task that has not started "
        "(pending, queued, retrying) can be marked expired",
        task_id=task_id,
        status=status,
    )


@dataclass(frozen=True)
class Swept:
    """One batch of the expiry sweep: ``due``, the members of ``dtq:expiry`` it looked at (as
    many as the limit: more may be due); ``expired``, (queue, task_type) of each task it marked
    EXPIRED, by task id."""

    due: int
    expired: dict[str, tuple[str, str]]


async def sweep_due(
    store: Store, now_ms: int, limit: int = SWEEP_BATCH, per_call: int = SWEEP_PER_CALL
) -> Swept:
    """Expire up to ``limit`` tasks whose deadline is due on the Redis clock, ``per_call`` tasks
    per ``expire.lua`` call, all of a batch's calls in one pipeline. The tasks are not read
    first: those that need their stream or idempotency record (queued, or with a key) come
    back with what their keys are made of and go in a second pipeline.

    The expire script re-checks each one on the server, so a task that started or was
    extended in between is left alone.
    """
    due = cast(list[str], await store.redis.zrangebyscore(keys.EXPIRY, "-inf", now_ms, 0, limit))
    expired: dict[str, tuple[str, str]] = {}
    todo: list[tuple[str, Where | None]] = [(tid, None) for tid in due]
    while todo:
        chunks = [todo[i : i + per_call] for i in range(0, len(todo), per_call)]
        calls = [_expire_call(store, chunk, "sweep", None) for chunk in chunks]
        todo = []
        replies = await store.scripts.call_many(store.redis, calls)
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            for (task_id, _), one in zip(chunk, reply, strict=True):
                if one[0] == "expired":
                    expired[str(task_id)] = (str(one[2]), str(one[3]))
                elif one[0] == "keys":
                    todo.append((str(task_id), (str(one[1]), int(one[2]), str(one[3] or ""))))
    return Swept(len(due), expired)


async def sweep_expired(store: Store, now_ms: int, limit: int = SWEEP_BATCH) -> list[str]:
    """Expire up to ``limit`` due tasks (:func:`sweep_due`); returns their ids."""
    return list((await sweep_due(store, now_ms, limit)).expired)
