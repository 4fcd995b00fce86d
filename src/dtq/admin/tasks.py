"""Cancel and expire one task (one script call each), and the scheduler's expiry sweep (batches
of due tasks, several tasks per ``expire.lua`` call)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from dtq import calls, keys
from dtq.admin._common import SWEEP_BATCH, SWEEP_PER_CALL, Audit
from dtq.calls import Where
from dtq.errors import (
    InvalidTransitionError,
    TaskNotFoundError,
    TaskRunningError,
    TaskTerminalError,
)
from dtq.models import TaskStatus
from dtq.store import Store

__all__ = ["Swept", "cancel", "expire", "sweep_due", "task_keys"]


async def task_keys(store: Store, task_ids: Sequence[str]) -> list[Where | None]:
    """(queue, priority, idempotency_key) of each task, None where the hash is gone."""
    pipe = store.redis.pipeline(transaction=False)
    for tid in task_ids:
        pipe.hmget(keys.task(tid), "queue", "priority", "idempotency_key")
    out: list[Where | None] = []
    for q, p, k in await pipe.execute():
        out.append(None if q is None else (q, int(p), k or ""))
    return out


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
    reply = await calls.cancel(store, task_id, where, reason, audit)
    if reply.kind == "cancelled":
        return reply.status
    if reply.kind == "requested":
        # A sync handler's thread that did not stop when interrupted is named by its worker
        # (docs/delivery-guarantees.md, "Sync handlers"): the worker cannot stop it.
        attempt, overdue = cast(
            list[str | None],
            await store.redis.hmget(keys.task(task_id), "attempt", "overdue_attempt"),
        )
        if attempt is not None and overdue == attempt:
            raise TaskRunningError(
                f"task {task_id} is running and its worker cannot stop it: the thread of its "
                f"sync handler (attempt {attempt}) did not stop when interrupted; cancellation "
                "requested, the task ends when that thread returns or its worker restarts",
                task_id=task_id,
                status=TaskStatus.RUNNING.value,
                overdue_attempt=int(attempt),
            )
        raise TaskRunningError(
            f"task {task_id} is running: cancellation requested, the worker stops it",
            task_id=task_id,
            status=TaskStatus.RUNNING.value,
        )
    if reply.kind == "not_found":
        raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    raise TaskTerminalError(
        f"task {task_id} is already {reply.status}: a finished task cannot be cancelled",
        task_id=task_id,
        status=reply.status,
    )


async def expire(store: Store, task_id: str, *, audit: Audit | None = None) -> str:
    """Mark a not-started task EXPIRED now; returns the status it expired from."""
    where = (await task_keys(store, [task_id]))[0]
    if where is None:
        raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    reply = await calls.expire(store, task_id, where, audit)
    if reply.kind == "expired":
        return reply.status
    if reply.kind == "not_found":
        raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    raise InvalidTransitionError(
        f"task {task_id} is {reply.status}: only a task that has not started "
        "(pending, queued, retrying) can be marked expired",
        task_id=task_id,
        status=reply.status,
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
    per ``expire.lua`` call (:func:`dtq.calls.expire_sweep`).

    The expire script re-checks each one on the server, so a task that started or was
    extended in between is left alone.
    """
    looked, expired = 0, {}
    for scope in await store.scopes():  # one expiry set per queue in the cluster layout
        if looked >= limit:
            break
        due = cast(
            list[str],
            await store.redis.zrangebyscore(keys.expiry(scope), "-inf", now_ms, 0, limit - looked),
        )
        if due:
            looked += len(due)
            expired.update(await calls.expire_sweep(store, scope, due, per_call))
    return Swept(looked, expired)
