"""Queue-level changes: pause, resume, and the purge of a queue's not-started tasks."""

from __future__ import annotations

from collections.abc import Sequence

from dtq import calls, keys
from dtq.admin._common import (
    CAS_TRIES,
    CHUNK,
    SCAN_CHUNK,
    Audit,
    check_queue,
    load_metadata,
    stream_rows,
)
from dtq.models import NOT_STARTED, compact_json
from dtq.store import Store

__all__ = ["purge_queue", "set_paused"]


async def set_paused(store: Store, queue: str, paused: bool, *, audit: Audit | None = None) -> bool:
    """Pause (workers stop reading the queue) or resume it; True when the state changed. A
    paused queue is listed in ``dtq:queues`` (by set_paused.lua itself in the flat layout; in
    the cluster one, where the registry is in another slot, just before)."""
    check_queue(queue)
    if paused and keys.cluster_layout():
        await store.redis.sadd(keys.QUEUES, queue)
    return await calls.set_paused(store, queue, paused, audit)


_Candidate = tuple[str, str, str]  # task_id, stream entry id seen ("" = schedule), band ("")


class _Purge:
    """State of one purge_queue run: the running count and the not-yet-written audit entry."""

    def __init__(self, store: Store, queue: str, audit: Audit | None) -> None:
        self.store = store
        self.queue = queue
        self.audit: Audit | None = audit  # until a chunk carries the audit entry
        self.cancelled = 0

    async def run(self, candidates: Sequence[_Candidate]) -> None:
        """Cancel the candidates that belong to the queue and have not started (CHUNK max)."""
        todo = list(candidates)
        for _ in range(CAS_TRIES):
            if not todo:
                return
            stale = await self._call(todo)
            todo = [c for c in todo if c[0] in stale]

    async def _call(self, candidates: Sequence[_Candidate]) -> set[str]:
        store, queue = self.store, self.queue
        pipe = store.redis.pipeline(transaction=False)
        for tid, _, _ in candidates:
            pipe.hmget(keys.task(tid), "status", "queue", "idempotency_key", "metadata")
        send: list[calls.PurgeCandidate] = []
        for (tid, seen, band), (status, q, idem, raw) in zip(
            candidates, await pipe.execute(), strict=True
        ):
            if status is None:  # an orphan entry or member: the script removes it
                expect = new = ""
            elif q == queue and status in NOT_STARTED:
                expect, new = raw or "", compact_json({**load_metadata(raw), "purged": True})
            else:
                continue
            send.append(calls.PurgeCandidate(tid, seen, band, idem or "", expect, new))
        if not send:
            return set()
        reply = await calls.purge_queue(store, queue, send, self.audit)
        self.cancelled += reply.cancelled
        self.audit = None
        return reply.stale

    async def scheduled(self) -> None:
        """Delayed and retrying members (and those the scheduler is promoting right now), then
        the tasks a fair queue holds back from its streams (docs/limits.md)."""
        q = self.queue
        for zkey in (keys.retry_schedule(q), keys.retry_claimed(q), keys.fair_held(q)):
            batch: list[_Candidate] = []
            async for member, _ in self.store.redis.zscan_iter(zkey, count=SCAN_CHUNK):
                batch.append((member, "", ""))
                if len(batch) == CHUNK:
                    await self.run(batch)
                    batch = []
            await self.run(batch)

    async def streams(self) -> None:
        """Entries of the queue's ten streams, up to the newest present at the start."""
        redis = self.store.redis
        for band in keys.PRIORITIES:
            stream = keys.stream(self.queue, band)
            newest = stream_rows(await redis.xrevrange(stream, "+", "-", count=1))
            if not newest:
                continue
            start, end = "-", newest[0][0]
            while True:
                rows = stream_rows(await redis.xrange(stream, start, end, count=CHUNK))
                await self.run([(f.get("task_id", ""), eid, str(band)) for eid, f in rows])
                if len(rows) < CHUNK:
                    break
                start = "(" + rows[-1][0]

    async def finish(self) -> None:
        """Write the audit entry if no chunk carried it (nothing to purge)."""
        if self.audit is not None:
            await calls.purge_queue(self.store, self.queue, [], self.audit)


async def purge_queue(store: Store, queue: str, *, audit: Audit | None = None) -> int:
    """Cancel every task of ``queue`` that has not started; returns how many were cancelled.

    Schedule members first, then the tasks a fair queue holds, then stream entries (a task
    promoted or moved meanwhile is then found in its stream). Hashes become CANCELLED with
    ``metadata.purged = true``; running tasks are left alone; one audit entry ``purge`` for the
    whole operation.
    """
    check_queue(queue)
    purge = _Purge(store, queue, audit)
    await purge.scheduled()
    await purge.streams()
    await purge.finish()
    return purge.cancelled
