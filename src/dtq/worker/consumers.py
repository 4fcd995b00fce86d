"""Consumers of the ``workers`` group that nobody needs any more are deleted.

Every worker id that reads a stream (``XREADGROUP``, ``XAUTOCLAIM``) becomes a consumer of that
stream's group, and Redis never removes one by itself: a deployment that restarts workers often
would pile them up. A consumer is deleted only by ``drop_consumers.lua``, which checks in the
same atomic step that it holds no pending entry (``XGROUP DELCONSUMER`` would destroy those
entries and lose their tasks). Who deletes:

- a worker at graceful stop, its own consumers on the streams of its queues
  (:func:`drop_own`); where the drain left an entry unacknowledged, that consumer stays;
- the scheduler leader, every stale-worker check (:func:`drop_dead`): the consumers of workers
  that are not alive (:func:`dtq.records.worker_liveness`: no ``dtq:worker:<id>`` hash, its
  heartbeat older than three intervals, or stopped) that hold no pending entry and have been
  idle for at least the visibility timeout, on the streams of the queues in ``dtq:queues``
  and of the queues live workers serve. A dead worker's pending entries are claimed by its
  peers' reapers after the visibility timeout; its consumer goes at the first check after.

A live worker whose idle consumer was deleted (its heartbeat was late, say) is not harmed: its
next read creates the consumer again, and an entry it holds keeps its consumer alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from dtq import calls, keys
from dtq.records import LIVENESS_FIELDS, worker_liveness
from dtq.store import Store

__all__ = ["drop_dead", "drop_own", "worker_states"]


async def drop_own(store: Store, worker_id: str, queues: Sequence[str]) -> list[str]:
    """Delete this worker's consumers on every stream of ``queues`` where it holds no entry;
    returns the streams where it still holds one (and its consumer stays)."""
    streams = [s for q in queues for s in keys.queue_streams(q)]
    replies = await calls.drop_consumers(store, [(s, [worker_id]) for s in streams])
    # Where it was not deleted: does it hold an entry there? One pipeline of XPENDING, its
    # replies walked with the scripts' in stream order (the first error met is the one raised).
    unsure = [
        s for s, r in zip(streams, replies, strict=True) if not isinstance(r, Exception) and not r
    ]
    pipe = store.redis.pipeline(transaction=False)
    for stream in unsure:
        pipe.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 1, consumername=worker_id)
    held = dict(zip(unsure, await pipe.execute(raise_on_error=False), strict=True))
    kept = []
    for stream, reply in zip(streams, replies, strict=True):
        if isinstance(reply, Exception):
            raise reply
        if reply:
            continue
        rows = held[stream]
        if isinstance(rows, Exception) and "NOGROUP" in str(rows):
            continue  # the stream is gone (an idle queue removed): it holds nothing
        if isinstance(rows, Exception):
            raise rows
        if rows:
            kept.append(stream)
    return kept


async def worker_states(store: Store, ids: Sequence[str]) -> list[dict[str, str | None] | None]:
    """The liveness fields of each of ``ids``' hash, in order (None: the hash is gone), in one
    pipeline: what :func:`dtq.records.worker_liveness` judges."""
    pipe = store.redis.pipeline(transaction=False)
    for wid in ids:
        pipe.exists(keys.worker(wid))
        pipe.hmget(keys.worker(wid), *LIVENESS_FIELDS)
    flat = await pipe.execute()
    return [
        dict(zip(LIVENESS_FIELDS, values, strict=True)) if exists else None
        for exists, values in zip(flat[::2], flat[1::2], strict=True)
    ]


async def drop_dead(
    store: Store, now_ms: int, stale_ms: int, min_idle_ms: int
) -> list[tuple[str, str]]:
    """Delete, on every stream of the known queues, the consumers of workers not alive that
    hold no pending entry and are idle for ``min_idle_ms``; returns (stream, consumer) pairs."""
    redis = store.redis
    pipe = redis.pipeline(transaction=False)
    pipe.smembers(keys.QUEUES)
    pipe.smembers(keys.WORKERS)
    queue_set, worker_set = await pipe.execute()
    queues = set(cast(set[str], queue_set))
    workers = sorted(cast(set[str], worker_set))
    if workers:
        pipe = redis.pipeline(transaction=False)
        for wid in workers:
            pipe.hget(keys.worker(wid), "queues")
        for served in await pipe.execute():
            queues.update(q for q in (served or "").split(",") if q)
    streams = [s for q in sorted(queues) for s in keys.queue_streams(q)]
    if not streams:
        return []
    idle = await _idle_consumers(store, streams, min_idle_ms)
    names = sorted({c for consumers in idle.values() for c in consumers})
    if not names:
        return []
    dead = {
        name
        for name, h in zip(names, await worker_states(store, names), strict=True)
        if not worker_liveness(h, now_ms, stale_ms).alive
    }
    drops = [
        (stream, [c for c in consumers if c in dead])
        for stream, consumers in idle.items()
        if any(c in dead for c in consumers)
    ]
    dropped: list[tuple[str, str]] = []
    for (stream, _), reply in zip(
        drops, await calls.drop_consumers(store, drops, min_idle_ms), strict=True
    ):
        if isinstance(reply, Exception):
            raise reply
        dropped.extend((stream, c) for c in reply)
    return dropped


async def _idle_consumers(
    store: Store, streams: Sequence[str], min_idle_ms: int
) -> dict[str, list[str]]:
    """stream -> its consumers that hold no entry and are idle for ``min_idle_ms`` (as seen
    now; the script checks again when it deletes)."""
    pipe = store.redis.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_consumers(stream, keys.CONSUMER_GROUP)
    out: dict[str, list[str]] = {}
    for stream, rows in zip(streams, await pipe.execute(raise_on_error=False), strict=True):
        if isinstance(rows, Exception):
            continue  # no such stream or group: no consumer
        names = [
            str(row["name"])
            for row in cast(list[dict[str, Any]], rows)
            if int(row["pending"]) == 0 and int(row["idle"]) >= min_idle_ms
        ]
        if names:
            out[stream] = names
    return out
