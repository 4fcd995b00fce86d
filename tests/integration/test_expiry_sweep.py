"""The expiry sweep in batches (docs/expiration.md): several tasks per ``expire.lua`` call, each one
changed exactly as alone, with the labels the metrics need in the reply; a backlog swept at
``SWEEP_RATE`` over consecutive ticks. Real Redis, the scheduler in-process, no worker."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, TaskStatus, keys
from dtq.admin import sweep_due
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.models import Task
from dtq.worker import scheduler as scheduler_module
from dtq.worker.scheduler import Scheduler, TickResult
from support import Events, wait_until
from support.scheduler import running
from support.worker import past_deadline

UNSERVED = "nobody-serves-this"


async def past(queue: Queue, r: Redis, tasks: list[Task]) -> int:
    """Wait until every deadline of ``tasks`` has passed on the Redis clock; returns now (ms)."""
    await past_deadline(queue, max(t.expires_at for t in tasks if t.expires_at is not None))
    return await redis_time_ms(r)


def as_task(t: Task | Exception) -> Task:
    assert isinstance(t, Task), t
    return t


async def test_several_tasks_per_call_each_expired_as_alone(queue: Queue, r: Redis) -> None:
    queued = [
        as_task(t)
        for t in await queue.submit_many(
            [
                {"task_type": "quick_task", "payload": {"i": i}, "idempotency_key": f"k{i}"}
                for i in range(9)
            ],
            queue=UNSERVED,
            priority=3,
            ttl_seconds=0.2,
        )
    ]
    delayed = [
        await queue.submit("send_reminder", {"user_id": str(i)}, delay_seconds=60, ttl_seconds=0.2)
        for i in range(8)
    ]
    moved = await queue.submit("quick_task", {}, queue=UNSERVED, ttl_seconds=0.2)
    finished = await queue.submit("quick_task", {}, queue=UNSERVED, ttl_seconds=0.2)
    gone = await queue.submit("quick_task", {}, queue=UNSERVED, ttl_seconds=0.2)
    everything = [*queued, *delayed, moved, finished, gone]
    now_ms = await past(queue, r, everything)
    # Not due any more (a reschedule extended it), already terminal, hash gone.
    await r.hset(keys.task(moved.task_id), "expires_at_ms", now_ms + 60_000)
    await r.hset(keys.task(finished.task_id), "status", "succeeded")
    await r.delete(keys.task(gone.task_id))

    async with Events(r) as events:
        swept = await sweep_due(queue.store, now_ms, limit=100, per_call=4)
        await events.wait_for("TASK_EXPIRED", count=17)
    assert swept.due == len(everything)
    expired = [*queued, *delayed]
    assert swept.expired == {t.task_id: (t.queue, t.task_type) for t in expired}
    for t in expired:
        done = await queue.get(t.task_id)
        assert done.status is TaskStatus.EXPIRED and done.expired_at is not None
        history = await queue.history(t.task_id)
        assert [(h.from_status, h.to_status) for h in history][-1] == (
            t.status,
            TaskStatus.EXPIRED,
        )
        assert history[-1].reason == "ttl"
        [event] = events.of("TASK_EXPIRED", t.task_id)
        assert (event.queue, event.task_type, event.attempt) == (t.queue, t.task_type, 0)
        assert event.metadata["reason"] == "ttl"
        assert event.metadata["expires_at"] == _iso(t)
    for i, t in enumerate(queued):
        record = json.loads(await r.get(keys.idempotency(UNSERVED, f"k{i}")))
        assert record == {**record, "task_id": t.task_id, "state": "failed"}
    assert await r.xlen(keys.stream(UNSERVED, 3)) == 0  # the queued entries are gone
    assert await r.zcard(keys.RETRY_SCHEDULE) == 0  # so are the delayed members
    assert await r.zrange(keys.EXPIRY, 0, -1, withscores=True) == [
        (moved.task_id, float(now_ms + 60_000))
    ]
    assert (await queue.get(moved.task_id)).status is TaskStatus.QUEUED
    assert (await queue.get(finished.task_id)).status is TaskStatus.SUCCEEDED
    # Not expired: their entries stay (a worker's start script acknowledges the finished one
    # and the one whose hash is gone).
    assert await r.xlen(keys.stream(UNSERVED, 5)) == 3


def _iso(t: Task) -> str:
    assert t.expires_at is not None
    return t.expires_at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, scheduler_interval_s=0.05)


async def test_a_backlog_is_swept_at_the_sweep_rate_over_ticks_without_pause(
    queue: Queue, r: Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 1,000 tasks/s and a budget of 0.2 s a tick sweeps at most 200 of 700 due tasks; the
    loop ticks again at once while a backlog is left, and every one ends EXPIRED."""
    monkeypatch.setattr(scheduler_module, "SWEEP_RATE", 1_000)
    monkeypatch.setattr(scheduler_module, "PHASE_BUDGET_S", 0.2)
    n = 700
    tasks = [
        as_task(t)
        for t in await queue.submit_many(
            [{"task_type": "quick_task", "payload": {"i": i}} for i in range(n)],
            queue=UNSERVED,
            ttl_seconds=0.2,
        )
    ]
    await past(queue, r, tasks)
    ticks: list[TickResult] = []
    # A pause between ticks would be 5 s: the 4 s deadline below sees one.
    slow_ticks = settings.model_copy(update={"scheduler_interval_s": 5})
    scheduler = Scheduler(queue.store, slow_ticks, "worker-sweeper1")
    first = await scheduler.tick()
    assert first.swept and 0 < len(first.expired) <= 200

    def observe(part: TickResult) -> None:
        ticks.append(part)

    scheduler.on_tick = observe
    async with running(scheduler):

        async def swept() -> bool:
            return await r.zcard(keys.EXPIRY) == 0

        await wait_until(swept, 4)
    assert all(len(part.expired) <= 100 for part in ticks)  # one call of on_tick per batch
    assert len(first.expired) + sum(len(p.expired) for p in ticks) == n
    statuses: dict[Any, int] = {}
    for t in await queue.store.get_many([t.task_id for t in tasks]):
        statuses[t.status] = statuses.get(t.status, 0) + 1
    assert statuses == {TaskStatus.EXPIRED: n}


async def test_a_tick_carries_the_labels_of_what_its_sweep_expired(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """The metrics observer counts the sweep's expirations from these labels, without reading
    every task hash again."""
    task = await queue.submit("quick_task", {}, queue=UNSERVED, ttl_seconds=0.1)
    await past(queue, r, [task])
    result = await Scheduler(queue.store, settings, "worker-sweeper2").tick()
    assert result.expired == [task.task_id]
    assert result.labels == {task.task_id: (UNSERVED, "quick_task")}


async def test_a_long_history_stays_capped_at_100(queue: Queue, r: Redis) -> None:
    task = await queue.submit("quick_task", {}, queue=UNSERVED, ttl_seconds=0.1)
    filler = json.dumps({"ts": "2026-01-01T00:00:00.000Z", "from": "queued", "to": "queued"})
    await r.rpush(keys.history(task.task_id), *[filler] * 99)
    now_ms = await past(queue, r, [task])
    assert list((await sweep_due(queue.store, now_ms)).expired) == [task.task_id]
    history = await r.lrange(keys.history(task.task_id), 0, -1)
    assert len(history) == 100
    assert json.loads(history[-1])["to"] == "expired"
    assert await r.ttl(keys.history(task.task_id)) > 0
