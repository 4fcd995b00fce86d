"""Dead letters: list, get, requeue, discard, purge (contract section 11).

The metadata a script writes (previous_attempts, discarded) is built here with Python's json and
compare-and-set by the script against the metadata read: Lua's cjson would turn ``[]`` into
``{}`` and round large integers in a user's metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from dtq import calls, keys
from dtq.admin._common import (
    CAS_TRIES,
    CHUNK,
    LIST_CAP,
    PREVIOUS_ATTEMPTS_CAP,
    SCAN_CHUNK,
    Audit,
    load_metadata,
    newest_entries,
    stream_rows,
)
from dtq.calls import DlqReply
from dtq.errors import InvalidTransitionError, NotInDeadLetterError, TaskNotFoundError
from dtq.models import Task, TaskStatus, compact_json
from dtq.records import DeadLetter
from dtq.store import Store

__all__ = ["dlq_discard", "dlq_get", "dlq_list", "dlq_purge", "dlq_requeue"]


async def dlq_list(store: Store, limit: int = 50) -> list[DeadLetter]:
    """The newest ``limit`` dead letters first (XREVRANGE; in the cluster layout, of each
    queue's dead-letter stream, merged newest first)."""
    limit = max(1, min(limit, LIST_CAP))
    rows = await newest_entries(store, keys.dead_letter, limit)
    return [DeadLetter.from_entry(eid, fields) for eid, fields in rows]


async def _find_dlq_entry(
    store: Store, task_id: str, queue: str, hint: str | None
) -> tuple[str, dict[str, str]] | None:
    """The task's DLQ entry (in its ``queue``'s dead-letter stream): the hash's
    ``dlq_entry_id`` first, else a scan, newest first."""
    redis = store.redis
    dead_letter = keys.dead_letter(queue)
    if hint:
        rows = stream_rows(await redis.xrange(dead_letter, hint, hint))
        if rows and rows[0][1].get("task_id") == task_id:
            return rows[0][0], rows[0][1]
    top = "+"
    while True:
        rows = stream_rows(await redis.xrevrange(dead_letter, top, "-", count=SCAN_CHUNK))
        for eid, fields in rows:
            if fields.get("task_id") == task_id:
                return eid, fields
        if len(rows) < SCAN_CHUNK:
            return None
        top = "(" + rows[-1][0]


def _not_in_dlq(task_id: str, status: str | None, meta: Mapping[str, Any]) -> NotInDeadLetterError:
    if status is None:
        why = "the task does not exist (or its record expired)"
    elif status == TaskStatus.EXPIRED:
        why = (
            "it is expired: it passed its deadline before it ran, and an expired task is never "
            "retried or requeued (expired means too late)"
        )
    elif status == TaskStatus.DEAD_LETTERED and meta.get("discarded"):
        why = "it was discarded from the dead-letter queue"
    elif status == TaskStatus.DEAD_LETTERED:
        why = "its entry is no longer in the dead-letter stream (trimmed)"
    else:
        why = f"it is {status}, not dead_lettered"
    return NotInDeadLetterError(
        f"task {task_id} is not in the dead-letter queue: {why}", task_id=task_id, status=status
    )


async def dlq_get(store: Store, task_id: str) -> DeadLetter:
    """The task's dead-letter entry; NotInDeadLetterError when it has none."""
    h = cast(
        list[str | None],
        await store.redis.hmget(keys.task(task_id), "status", "dlq_entry_id", "metadata", "queue"),
    )
    found = await _find_dlq_entry(store, task_id, h[3] or "", h[1])
    if found is None:
        raise _not_in_dlq(task_id, h[0], load_metadata(h[2]))
    return DeadLetter.from_entry(*found)


async def _dead_lettered(
    store: Store, task_id: str, verb: str
) -> tuple[dict[str, str], dict[str, Any], str]:
    """(hash, metadata, DLQ entry id to fall back on) of a task that is in the DLQ, else raise."""
    h = cast(dict[str, str], await store.redis.hgetall(keys.task(task_id)))
    if not h:
        raise TaskNotFoundError(
            f"task {task_id} not found: it cannot be {verb} (a dead letter whose task record "
            "expired can only be discarded from the stream by a purge)",
            task_id=task_id,
        )
    meta = load_metadata(h.get("metadata"))
    if h.get("status") != TaskStatus.DEAD_LETTERED or meta.get("discarded"):
        raise _not_in_dlq(task_id, h.get("status"), meta)
    fallback = ""
    if not h.get("dlq_entry_id"):
        found = await _find_dlq_entry(store, task_id, h.get("queue", ""), None)
        fallback = found[0] if found else ""
    return h, meta, fallback


def _dlq_refused(task_id: str, reply: DlqReply, verb: str) -> Exception | None:
    """The error a refused DLQ script reply means; None for STALE (read again and retry)."""
    if reply.code == "STALE":
        return None
    if reply.code == "NOT_FOUND":
        return TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
    if reply.code == "DEADLINE":
        return InvalidTransitionError(
            f"task {task_id} cannot be {verb}: its deadline (expires_at {reply.detail}) has "
            "passed, so it would expire before running (expired means too late)",
            task_id=task_id,
            status=TaskStatus.DEAD_LETTERED.value,
            expires_at=reply.detail,
        )
    return _not_in_dlq(task_id, reply.detail, {})


def _changed_meanwhile(task_id: str, verb: str) -> InvalidTransitionError:
    return InvalidTransitionError(
        f"task {task_id} kept changing while it was being {verb}; try again", task_id=task_id
    )


def _previous_attempt(h: Mapping[str, str]) -> dict[str, Any]:
    return {
        "attempts": int(h.get("attempt") or 0),
        "last_error_class": h.get("error_class") or None,
        "last_error": h.get("error_message") or None,
        "failed_at": h.get("finished_at") or h.get("updated_at") or None,
        "worker_id": h.get("worker_id") or None,
    }


async def dlq_requeue(store: Store, task_id: str, *, audit: Audit | None = None) -> Task:
    """Give a DEAD_LETTERED task a new life: QUEUED, attempt 0, earlier attempts kept.

    NotInDeadLetterError for any other status (an EXPIRED task is never requeued: expired means
    too late) or a discarded one; InvalidTransitionError when its deadline has passed.
    """
    for _ in range(CAS_TRIES):
        h, meta, fallback = await _dead_lettered(store, task_id, "requeued")
        previous = meta.get("previous_attempts")
        previous = list(previous) if isinstance(previous, list) else []
        previous.append(_previous_attempt(h))
        meta["previous_attempts"] = previous[-PREVIOUS_ATTEMPTS_CAP:]
        reply = await calls.dlq_requeue(
            store,
            task_id,
            h["queue"],
            h.get("idempotency_key") or "",
            h.get("metadata", ""),
            compact_json(meta),
            fallback,
            audit,
        )
        if reply.ok:
            return await store.get(task_id)
        error = _dlq_refused(task_id, reply, "requeued")
        if error is not None:
            raise error
    raise _changed_meanwhile(task_id, "requeued")


async def dlq_discard(store: Store, task_id: str, *, audit: Audit | None = None) -> None:
    """Remove the task's entry from the DLQ stream; the hash stays DEAD_LETTERED with
    ``metadata.discarded = true`` (never deleted)."""
    for _ in range(CAS_TRIES):
        h, meta, fallback = await _dead_lettered(store, task_id, "discarded")
        meta["discarded"] = True
        reply = await calls.dlq_discard(
            store,
            task_id,
            h.get("queue", ""),
            h.get("metadata", ""),
            compact_json(meta),
            fallback,
            audit,
        )
        if reply.ok:
            return
        error = _dlq_refused(task_id, reply, "discarded")
        if error is not None:
            raise error
    raise _changed_meanwhile(task_id, "discarded")


async def dlq_purge(store: Store, *, audit: Audit | None = None) -> int:
    """Empty the DLQ stream of every entry it holds now (each queue's, in the cluster layout);
    returns how many were removed.

    Chunks of ``CHUNK`` entries, oldest first, up to the newest entry seen at the start (a task
    dead-lettered meanwhile stays). Each removed entry's task is marked ``discarded``. The
    operation's audit entry goes with the first chunk (of each queue that had entries, in the
    cluster layout, whose audit streams are per queue); with nothing to remove it is still
    written (to ``default``'s audit stream in the cluster layout).
    """
    removed = 0
    audited = False
    for scope in await store.scopes():
        n, wrote = await _purge_scope(store, scope, audit)
        removed += n
        audited = audited or wrote
    if audit is not None and not audited:  # nothing was there: the purge is still recorded
        await calls.dlq_purge(store, "default", [], audit)
    return removed


async def _purge_scope(store: Store, scope: str, audit: Audit | None) -> tuple[int, bool]:
    """:func:`dlq_purge` of one dead-letter stream: (entries removed, audit entry written)."""
    redis = store.redis
    dead_letter = keys.dead_letter(scope)
    newest = stream_rows(await redis.xrevrange(dead_letter, "+", "-", count=1))
    end = newest[0][0] if newest else None
    pending_audit = audit
    removed = 0
    start = "-"
    while end is not None:
        rows = stream_rows(await redis.xrange(dead_letter, start, end, count=CHUNK))
        if not rows:
            break
        pipe = redis.pipeline(transaction=False)
        for _, fields in rows:
            pipe.hmget(keys.task(fields.get("task_id", "")), "status", "metadata")
        chunk: list[tuple[str, str, str, str]] = []
        for (eid, fields), (status, raw) in zip(rows, await pipe.execute(), strict=True):
            new = ""
            if status == TaskStatus.DEAD_LETTERED:
                new = compact_json({**load_metadata(raw), "discarded": True})
            chunk.append((eid, fields.get("task_id", ""), raw or "", new))
        removed += await calls.dlq_purge(store, scope, chunk, pending_audit)
        pending_audit = None  # the first chunk carried the operation's audit entry
        if len(rows) < CHUNK:
            break
        start = "(" + rows[-1][0]
    return removed, audit is not None and pending_audit is None
