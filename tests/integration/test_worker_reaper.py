"""The reaper (contract section 6) and the reads of the poll loops that
share a worker's capacity with it: a dead worker's entries go ahead of fresh reads, also on a
worker whose every slot is taken, and the worker never runs more than its concurrency."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.worker import fast, handlers, read_as, start_as, stream_empty, wait_status

pytestmark = pytest.mark.backends("single", "cluster")

DEAD = "worker-deaddead"


def default_stream() -> str:
    """The default queue's p5 stream, in the layout of the test's backend."""
    return keys.stream("default", 5)


class Load:
    """A handler that sleeps ``payload["s"]`` and records how many run at once."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.started: list[tuple[str, int]] = []

    async def __call__(self, payload: dict[str, Any], ctx: TaskContext) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        self.started.append((ctx.task_id, ctx.attempt))
        try:
            await asyncio.sleep(payload["s"])
        finally:
            self.running -= 1


async def _pending_of(r: Redis, consumer: str, idle_ms: int | None = None) -> list[str]:
    rows = await r.xpending_range(
        default_stream(), keys.CONSUMER_GROUP, "-", "+", 100, consumername=consumer, idle=idle_ms
    )
    return [str(row["message_id"]) for row in rows]


async def test_fully_busy_worker_reclaims_dead_entries_on_its_first_pass(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """A dead worker left two entries: one read and never started, one started (crashed in its
    handler). Another worker, every slot taken under a steady backlog, runs one reaper pass
    once they are idle past the visibility timeout: the pass claims both and starts them
    while fresh entries still wait, never more than its concurrency at once. (That the next
    slots to free go to the reclaimed entries first is tests/unit/test_capacity.py's.)"""
    read_only = await queue.submit("wt_load", {"s": 0})
    crashed = await queue.submit("wt_load", {"s": 0})
    await read_as(r, DEAD)
    await start_as(r, await read_as(r, DEAD), DEAD, settings)
    await queue.submit_many([{"task_type": "wt_load", "payload": {"s": 0.05}}] * 200)
    load = Load()
    # The reaper loop's first pass would come after 600 s: the test makes the one pass.
    s = fast(settings, visibility_timeout_s=1.0, reaper_interval_s=600)
    async with running_worker(s, handlers(wt_load=load), concurrency=2) as w:

        async def busy_and_dead_idle() -> bool:
            mine = await _pending_of(r, w.worker_id)
            return len(mine) == 2 and len(await _pending_of(r, DEAD, idle_ms=1000)) == 2

        await wait_until(busy_and_dead_idle, 10, "worker busy, dead entries past the timeout")
        assert await w.reap_once() == 2
        assert await _pending_of(r, DEAD) == []
        waiting = await r.xlen(default_stream()) - len(await _pending_of(r, w.worker_id))
        assert waiting > 0  # fresh entries were still queued at the pass: a busy worker
        first = await wait_status(r, read_only.task_id, "succeeded")
        second = await wait_status(r, crashed.task_id, "succeeded")
    assert (first["attempt"], first["worker_id"]) == ("1", w.worker_id)
    assert (second["attempt"], second["worker_id"]) == ("2", w.worker_id)
    assert (read_only.task_id, 1) in load.started and (crashed.task_id, 2) in load.started
    assert load.most == 2


async def test_reaper_pass_with_nothing_idle_takes_no_slot(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """Entries of a live worker (renewed by its heartbeat) are not claimed, and a pass that
    finds nothing does not hold up the poll loops of a busy worker."""
    await queue.submit_many([{"task_type": "wt_load", "payload": {"s": 0.05}}] * 40)
    load = Load()
    s = fast(settings, reaper_interval_s=600)
    async with running_worker(s, handlers(wt_load=load), concurrency=2) as w:
        await wait_until(lambda: _has_pending(r, w.worker_id, 2), 10, "worker busy")
        assert await w.reap_once() == 0
        await wait_until(lambda: stream_empty(r, default_stream()), 20, "all 40 done")
    assert len(load.started) == 40 and load.most == 2


async def _has_pending(r: Redis, consumer: str, n: int) -> bool:
    return len(await _pending_of(r, consumer)) == n
