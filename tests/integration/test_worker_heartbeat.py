"""Heartbeat and lease renewal (contract section 6, DESIGN 3, 5): the worker hash and its
lifecycle, the owner-checked touch, long tasks kept past the visibility timeout, and the Redis
clock for a skewed local clock. A handler that blocks the event loop: test_worker_stall.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.calls import entry_key, touch
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.worker import (
    backend,
    fast,
    handlers,
    read_as,
    wait_status,
)

WORKER_FIELDS = {
    "worker_id",
    "hostname",
    "started_at",
    "last_heartbeat",
    "last_heartbeat_ms",
    "active_tasks",
    "concurrency",
    "tasks_processed",
    "tasks_failed",
    "tasks_retried",
    "status",
    "queues",
    "pid",
}


async def test_worker_hash_fields_status_and_ttl(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    release = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        await release.wait()

    s = fast(settings)
    async with running_worker(s, handlers(wt_hold=hold), queues=("a", "b"), concurrency=3) as w:
        key = keys.worker(w.worker_id)
        assert w.worker_id.startswith("worker-") and len(w.worker_id) == len("worker-") + 8
        await wait_until(lambda: _status(r, key, "ready"), 5, "ready")
        h = await r.hgetall(key)
        assert set(h) == WORKER_FIELDS
        assert h["queues"] == "a,b" and h["concurrency"] == "3"
        assert await r.sismember(keys.WORKERS, w.worker_id)
        ttl_ms = await r.pttl(key)
        assert 0 < ttl_ms <= 3 * s.heartbeat_interval_s * 1000 + 50
        task = await queue.submit("wt_hold", {}, queue="b")
        await wait_until(lambda: _status(r, key, "busy"), 5, "busy")
        assert await r.hget(key, "active_tasks") == "1"
        release.set()
        await wait_status(r, task.task_id, "succeeded")
        await wait_until(lambda: _status(r, key, "ready"), 5, "ready again")
        assert await r.hget(key, "tasks_processed") == "1"
    assert await r.hget(key, "status") == "stopped"
    assert not await r.sismember(keys.WORKERS, w.worker_id)


async def _status(r: Redis, key: str, status: str) -> bool:
    return await r.hget(key, "status") == status


async def test_status_draining_while_in_flight_work_finishes(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    release = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> str:
        await release.wait()
        return "done"

    async with running_worker(fast(settings), handlers(wt_hold=hold)) as w:
        task = await queue.submit("wt_hold", {})
        await wait_status(r, task.task_id, "running")
        w.stop()
        await wait_until(lambda: _status(r, keys.worker(w.worker_id), "draining"), 5, "drain")
        release.set()
        await wait_status(r, task.task_id, "succeeded")


async def test_touch_renews_only_owned_entries(settings: Settings, r: Redis, queue: Queue) -> None:
    await queue.submit("wt_x", {})
    entry = await read_as(r, "worker-owner000")
    stream = entry.stream

    async def idle_50ms() -> bool:
        [p] = await r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 10)
        return int(p["time_since_delivered"]) >= 50

    await wait_until(idle_50ms, 2, "idle entry")
    db = backend(r, settings)
    owned = [(stream, entry.entry_id, entry.task_id)]
    lost = [entry_key(stream, entry.entry_id)]
    assert await touch(db, "worker-thief000", owned) == lost  # not owned: lost
    [p] = await r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 10)
    assert p["consumer"] == "worker-owner000" and p["times_delivered"] == 1
    assert p["time_since_delivered"] >= 40
    assert await touch(db, "worker-owner000", owned) == []
    [p] = await r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 10)
    assert p["consumer"] == "worker-owner000"
    assert p["times_delivered"] == 1  # JUSTID: the delivery counter is not bumped
    assert p["time_since_delivered"] < 40
    # A stream or entry that is gone is lost, without an error, unless the task hash still
    # says this worker runs that entry (removed outside dtq: the hash is the lease then).
    gone = [("dtq:stream:nope:p1", "1-1", entry.task_id)]
    assert await touch(db, "worker-owner000", gone) == ["dtq:stream:nope:p1 1-1"]
    await r.hset(keys.task(entry.task_id), mapping={"status": "running", "entry_id": "1-1"})
    await r.hset(keys.task(entry.task_id), "worker_id", "worker-owner000")
    assert await touch(db, "worker-owner000", gone) == []
    assert await touch(db, "worker-thief000", gone) == ["dtq:stream:nope:p1 1-1"]


async def test_long_task_keeps_its_lease_past_the_visibility_timeout(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    runs: list[tuple[str, int]] = []

    async def long(payload: dict[str, Any], ctx: TaskContext) -> None:
        runs.append((ctx.worker_id, ctx.attempt))
        await asyncio.sleep(2.0)

    s = fast(settings, visibility_timeout_s=0.6, heartbeat_interval_s=0.1, reaper_interval_s=0.1)
    hs = handlers(wt_long=long)
    async with running_worker(s, hs) as a:
        task = await queue.submit("wt_long", {})
        await wait_status(r, task.task_id, "running")
        async with running_worker(s, hs):
            h = await wait_status(r, task.task_id, "succeeded", timeout_s=10)
    assert runs == [(a.worker_id, 1)]
    assert h["attempt"] == "1"


async def test_worker_with_skewed_local_clock_uses_the_redis_clock(
    settings: Settings, r: Redis, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local clock is an hour ahead: deadlines, heartbeats and expiry still follow Redis."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    ran: list[str] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(ctx.task_id)
        server_ms = await redis_time_ms(r)
        assert abs(ctx.deadline.timestamp() * 1000 - (server_ms + 30_000)) < 5_000

    expiring = await queue.submit("wt_rec", {}, ttl_seconds=60)
    live = await queue.submit("wt_rec", {}, timeout_ms=30_000)
    async with running_worker(fast(settings), handlers(wt_rec=record)) as w:
        await wait_status(r, live.task_id, "succeeded")
        await wait_status(r, expiring.task_id, "succeeded")  # 60 s on the Redis clock: runs
        beat_ms = int(await r.hget(keys.worker(w.worker_id), "last_heartbeat_ms"))
        assert abs(beat_ms - await redis_time_ms(r)) < 5_000
        soon = await queue.submit("wt_rec", {}, ttl_seconds=0.2, delay_seconds=0.5)
        await wait_status(r, soon.task_id, "expired", timeout_s=5)
    assert soon.task_id not in ran
    assert sorted(ran) == sorted([live.task_id, expiring.task_id])
