"""What an operator reads: queue statistics, workers, the audit log. Pipelined reads only.

Exactness of each value is in docs/operations-admin.md: depth and pending are exact at one
instant (one pipeline); retry_scheduled is counted per queue by one chunked pass over the
schedule; workers are judged alive or stale from their heartbeat's age on the Redis clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from redis.exceptions import ClusterDownError, ResponseError, TryAgainError

from dtq import keys
from dtq.admin._common import LIST_CAP, SCAN_CHUNK, check_queue, newest_entries
from dtq.clock import time_reply_ms
from dtq.errors import WorkerNotFoundError
from dtq.records import (
    DEPTH_READS,
    AuditEntry,
    QueueStats,
    WorkerInfo,
    queue_depth,
    read_depth,
    stale_after_ms,
)
from dtq.store import Store

__all__ = ["all_queue_stats", "audit_log", "queue_stats", "worker", "workers"]


async def queue_stats(store: Store, queue: str) -> QueueStats:
    """The numbers of one queue (a queue never used has zeros)."""
    check_queue(queue)
    return (await _stats(store, [queue]))[0]


async def all_queue_stats(store: Store) -> list[QueueStats]:
    """The numbers of every queue in ``dtq:queues``, by name."""
    return await _stats(store, await store.queues())


async def _stats(store: Store, queues: Sequence[str]) -> list[QueueStats]:
    """Round trip 1: every XLEN, XPENDING and paused flag, the DLQ's XLEN, the worker set and
    the Redis clock; 2: the worker hashes; then the chunked pass over the schedule."""
    redis = store.redis
    dead_letters = [keys.dead_letter(scope) for scope in await store.scopes()]
    pipe = redis.pipeline(transaction=False)
    for q in queues:
        read_depth(pipe, q)
        pipe.exists(keys.queue_paused(q))
    for key in dead_letters:  # every queue's, in the cluster layout: dlq_depth is the total
        pipe.xlen(key)
    pipe.smembers(keys.WORKERS)
    pipe.execute_command("TIME")  # not .time(): a cluster pipeline refuses that name
    replies = await pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, (ClusterDownError, TryAgainError)) or (
            isinstance(reply, Exception) and not isinstance(reply, ResponseError)
        ):
            raise reply  # no answer (a failover under way) is no figure
    members, now = replies[-2:]
    dlq_depth = sum(int(n) for n in replies[-2 - len(dead_letters) : -2])
    live = [w for w in await _worker_infos(store, members, time_reply_ms(now)) if w.alive]
    scheduled = await _scheduled_per_queue(store, queues)
    out = []
    per_queue = DEPTH_READS + 1
    for i, q in enumerate(queues):
        chunk = replies[i * per_queue : (i + 1) * per_queue]
        depth, pending = queue_depth(chunk[:-1])
        out.append(
            QueueStats(
                queue=q,
                depth=depth,
                pending=pending,
                waiting=max(0, depth - pending),
                paused=bool(chunk[-1]),
                retry_scheduled=scheduled[q],
                dlq_depth=int(dlq_depth),
                workers_active=sum(1 for w in live if q in w.queues),
            )
        )
    return out


async def _scheduled_per_queue(store: Store, queues: Sequence[str]) -> Counter[str]:
    """Members of ``dtq:retry:schedule`` per queue: one pass over the zset in chunks (in the
    cluster layout, each of ``queues`` has its own: their ZCARDs)."""
    counts: Counter[str] = Counter()
    if keys.cluster_layout():
        pipe = store.redis.pipeline(transaction=False)
        for q in queues:
            pipe.zcard(keys.retry_schedule(q))
        counts.update(dict(zip(queues, await pipe.execute(), strict=True)))
        return counts
    seen: set[str] = set()  # ZSCAN may return a member twice
    batch: list[str] = []

    async def count(ids: list[str]) -> None:
        pipe = store.redis.pipeline(transaction=False)
        for tid in ids:
            pipe.hget(keys.task(tid), "queue")
        counts.update(q for q in await pipe.execute() if q)

    async for member, _ in store.redis.zscan_iter(keys.retry_schedule(""), count=SCAN_CHUNK):
        if member in seen:
            continue
        seen.add(member)
        batch.append(member)
        if len(batch) == SCAN_CHUNK:
            await count(batch)
            batch = []
    if batch:
        await count(batch)
    return counts


async def _worker_infos(store: Store, members: Iterable[str], now_ms: int) -> list[WorkerInfo]:
    ids = sorted(members)
    pipe = store.redis.pipeline(transaction=False)
    for wid in ids:
        pipe.hgetall(keys.worker(wid))
    stale_ms = stale_after_ms(store.settings.heartbeat_interval_s)
    return [
        WorkerInfo.from_hash(wid, h, now_ms, stale_ms)
        for wid, h in zip(ids, await pipe.execute(), strict=True)
        if h  # its hash expired: the scheduler removes it from the set
    ]


async def workers(store: Store) -> list[WorkerInfo]:
    """Every worker in ``dtq:workers`` whose hash still exists, by id; alive/stale judged here
    from the heartbeat's age on the Redis clock (stale: older than 3 heartbeat intervals)."""
    pipe = store.redis.pipeline(transaction=False)
    pipe.smembers(keys.WORKERS)
    pipe.execute_command("TIME")  # not .time(): a cluster pipeline refuses that name
    members, now = await pipe.execute()
    return await _worker_infos(store, members, time_reply_ms(now))


async def worker(store: Store, worker_id: str) -> WorkerInfo:
    """One worker by id (whether or not it is still in ``dtq:workers``)."""
    pipe = store.redis.pipeline(transaction=False)
    pipe.execute_command("TIME")  # not .time(): a cluster pipeline refuses that name
    now = (await pipe.execute())[0]
    found = await _worker_infos(store, [worker_id], time_reply_ms(now))
    if not found:
        raise WorkerNotFoundError(
            f"worker {worker_id} not found (it stopped, or its heartbeat expired)",
            worker_id=worker_id,
        )
    return found[0]


async def audit_log(store: Store, limit: int = 50) -> list[AuditEntry]:
    """The newest ``limit`` audit entries first."""
    limit = max(1, min(limit, LIST_CAP))
    rows = await newest_entries(store, keys.audit, limit, also="default")
    return [AuditEntry.from_entry(eid, fields) for eid, fields in rows]
