"""Queue names are not kept forever: idle queues are removed, and so are the ``dtq:cancelled``
members no start script will ever need (DESIGN 11; docs/redis-schema.md, "Queue lifetime").

The scheduler leader runs both (``Scheduler._remove_idle_queues``): a step of the pass every
tenth of the idle TTL (1 to 60 s), or at every tick while a pass is under way, and the
cancelled-set cleanup at the end of each pass.

- :class:`IdleQueues` walks ``dtq:queues`` one page per step. A queue that is not ``default``
  and that no live worker serves is checked by ``remove_queue.lua`` (its streams empty,
  nothing pending, no submit and no entry added for ``DTQ_QUEUE_IDLE_TTL_S``); for those the
  check finds idle, one pass over ``dtq:retry:schedule`` then ``dtq:retry:claimed`` (in that
  order: a member moves from the schedule to the claimed set, and from there to its stream)
  finds the queues of delayed, retrying and claimed tasks, which stay; the others are removed
  by the same script, which checks everything again and refuses when the queue's activity
  mark has moved since the check (so a task that joined the schedule after the scan is seen).
- :func:`clean_cancelled` removes the members of ``dtq:cancelled`` whose task hash is gone or
  whose stream entry is: the member exists so that the start script of a delivered entry sees
  the cancel; an entry removed by other means (a purge of an orphan, a hand-made XDEL, a stream
  deleted) is never started, and an entry id never comes back, so removing such a member
  cannot race with a start.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from typing import Any, cast

from dtq import calls, keys
from dtq.store import Store

__all__ = ["DEFAULT_QUEUE", "GATHER", "PAGE", "IdleQueues", "clean_cancelled"]

log = logging.getLogger(__name__)

DEFAULT_QUEUE = "default"  # never removed
PAGE = 500  # registry members (and schedule or cancelled members) looked at per round trip
GATHER = 2_000  # idle queues gathered over the pages before one scan of the schedule


class IdleQueues:
    """The leader's pass over ``dtq:queues``, one page per :meth:`step`.

    Each step checks the queues of one page (``SSCAN``); those found idle wait, with their mark,
    until the pass is complete or ``GATHER`` of them are, and then one scan of the schedule and
    one round trip of removals handle them all. The mark keeps a removal exact however long its
    queue waited since its check (remove_queue.lua's header)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cursor = 0  # of the SSCAN; 0 once a pass is complete
        self.idle: dict[str, str] = {}  # queue -> the mark of its check

    async def step(self, keep: Container[str]) -> tuple[list[str], bool]:
        """One page of the pass; ``keep``: the queues live workers serve (``default`` is never
        removed). Returns the queues removed and whether the pass is complete."""
        cursor, names = await self.store.redis.sscan(keys.QUEUES, self.cursor, count=PAGE)
        self.cursor = int(cursor)
        page = sorted({str(n) for n in names if n != DEFAULT_QUEUE and n not in keep})
        for queue, reply in zip(
            page, await calls.remove_queue(self.store, [(q, None) for q in page]), strict=True
        ):
            if isinstance(reply, Exception):  # that queue's keys are not dtq's (a wrong type)
                log.error("idle check of queue %s failed: %s", queue, reply)
            elif reply.kind == "idle":
                self.idle[queue] = reply.detail
        done = self.cursor == 0
        if not self.idle or (not done and len(self.idle) < GATHER):
            return [], done
        idle, self.idle = self.idle, {}
        cluster = keys.cluster_layout()
        # The cluster layout's script checks the queue's own sets itself.
        scheduled = set() if cluster else await _scheduled_queues(self.store, set(idle))
        todo = [(q, mark) for q, mark in idle.items() if q not in scheduled and q not in keep]
        if cluster and todo:
            # The registry is in another slot: the name leaves it first and comes back unless
            # the script removed the queue, so a submit racing the removal (which lists its
            # queue after its script) always leaves the queue listed (docs/redis-schema.md).
            await self.store.redis.srem(keys.QUEUES, *(q for q, _ in todo))
        removed: list[str] = []
        kept: list[str] = []
        try:
            replies = await calls.remove_queue(self.store, todo)
        except BaseException:
            if cluster and todo:
                await self.store.redis.sadd(keys.QUEUES, *(q for q, _ in todo))
            raise
        for (queue, _), reply in zip(todo, replies, strict=True):
            if isinstance(reply, Exception):
                log.error("removal of idle queue %s failed: %s", queue, reply)
                kept.append(queue)
            elif reply.kind == "removed":
                removed.append(queue)
            else:
                kept.append(queue)
        if cluster and kept:
            await self.store.redis.sadd(keys.QUEUES, *kept)
        return removed, done


async def _scheduled_queues(store: Store, wanted: set[str]) -> set[str]:
    """Which of ``wanted`` have a task in ``dtq:retry:schedule`` or ``dtq:retry:claimed``: one
    pass over each (schedule first), ``PAGE`` hash lookups per round trip, ending early once all
    of ``wanted`` are found."""
    found: set[str] = set()
    if keys.cluster_layout():  # each queue has its own schedule and claimed set
        pipe = store.redis.pipeline(transaction=False)
        for q in sorted(wanted):
            pipe.zcard(keys.retry_schedule(q))
            pipe.zcard(keys.retry_claimed(q))
        counts = await pipe.execute()
        return {
            q for q, a, b in zip(sorted(wanted), counts[::2], counts[1::2], strict=True) if a or b
        }
    for zkey in (keys.retry_schedule(""), keys.retry_claimed("")):
        batch: list[str] = []
        async for member, _ in store.redis.zscan_iter(zkey, count=PAGE):
            batch.append(member)
            if len(batch) == PAGE:
                found.update(await _queues_of(store, batch))
                batch = []
                if wanted <= found:
                    return found
        found.update(await _queues_of(store, batch))
        if wanted <= found:
            return found
    return found


async def _queues_of(store: Store, task_ids: Sequence[str]) -> set[str]:
    if not task_ids:
        return set()
    pipe = store.redis.pipeline(transaction=False)
    for tid in task_ids:
        pipe.hget(keys.task(tid), "queue")
    return {q for q in await pipe.execute() if q}


async def clean_cancelled(store: Store) -> int:
    """Remove the ``dtq:cancelled`` members whose task hash or stream entry is gone; returns how
    many were removed."""
    redis = store.redis
    removed = 0
    for scope in await store.scopes():  # one set per queue in the cluster layout
        stale: list[str] = []
        batch: list[str] = []
        async for member in redis.sscan_iter(keys.cancelled(scope), count=PAGE):
            batch.append(str(member))
            if len(batch) == PAGE:
                stale += await _stale_cancelled(store, batch)
                batch = []
        stale += await _stale_cancelled(store, batch)
        if stale:
            await redis.srem(keys.cancelled(scope), *stale)
        removed += len(stale)
    return removed


async def _stale_cancelled(store: Store, task_ids: Sequence[str]) -> list[str]:
    """Those of ``task_ids`` whose hash is gone or whose stream entry is (two round trips)."""
    if not task_ids:
        return []
    pipe = store.redis.pipeline(transaction=False)
    for tid in task_ids:
        pipe.hmget(keys.task(tid), "queue", "priority", "entry_id")
    rows = cast(list[list[Any]], await pipe.execute())
    stale: list[str] = []
    lookups: list[str] = []
    pipe = store.redis.pipeline(transaction=False)
    for tid, (queue, priority, entry_id) in zip(task_ids, rows, strict=True):
        if queue is None or not entry_id:
            stale.append(tid)  # no hash (or no entry): a start would only acknowledge
            continue
        try:
            stream = keys.stream(queue, int(priority))
        except (TypeError, ValueError):
            continue  # a foreign write: leave it alone
        pipe.xrange(stream, entry_id, entry_id, count=1)
        lookups.append(tid)
    if lookups:
        for tid, rows_found in zip(lookups, await pipe.execute(), strict=True):
            if not rows_found:
                stale.append(tid)
    return stale
