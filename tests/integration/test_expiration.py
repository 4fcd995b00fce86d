"""Expiration that needs no worker (docs/expiration.md, with the edge cases it lists): the
scheduler's sweep of dtq:expiry and the promote script's deadline check, on the Redis clock.
Real Redis; the scheduler runs in-process, no worker polls any queue."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

import pytest
from redis.asyncio import Redis

from dtq import Queue, TaskStatus, calls, keys
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.errors import InvalidTransitionError, TaskTerminalError
from dtq.models import HistoryEntry, Task
from dtq.store import ms_to_dt
from dtq.worker import scheduler as scheduler_module
from dtq.worker.scheduler import Scheduler
from support import Events, wait_until
from support.scheduler import running

pytestmark = pytest.mark.backends("single", "cluster")

WORKER_A = "worker-aaaaaaaa"
UNSERVED = "nobody-serves-this"


# -- helpers --------------------------------------------------------------------------------------


def reaches(queue: Queue, task_id: str, status: TaskStatus) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await queue.get(task_id)).status is status

    return check


async def assert_nothing_left(r: Redis, task: Task) -> None:
    """No expired task leaves anything behind in a stream, the schedule or the index."""
    q = task.queue
    for key in (keys.retry_schedule(q), keys.retry_claimed(q), keys.expiry(q)):
        assert await r.zscore(key, task.task_id) is None, key
    for stream in keys.queue_streams(task.queue):
        assert await r.xlen(stream) == 0, stream


def path(history: list[HistoryEntry]) -> list[tuple[str | None, str]]:
    return [(h.from_status.value if h.from_status else None, h.to_status.value) for h in history]


async def make_retrying(r: Redis, queue: Queue, task_id: str, due_ms: int) -> None:
    """What the worker leaves after attempt 1 failed with a retryable error (start.lua then
    finish.lua): entry ACKed and deleted, RUNNING then RETRYING in the history, due in the
    schedule. The expiry member stays (retries keep expires_at)."""
    task = await queue.get(task_id)
    assert task.entry_id is not None
    await r.xdel(keys.stream(task.queue, task.priority), task.entry_id)
    await r.hset(
        keys.task(task_id),
        mapping={"status": "retrying", "attempt": 1, "retry_delay_ms": 100, "entry_id": ""},
    )
    ts = (await queue.now()).isoformat()
    for src, dst in (("queued", "running"), ("running", "retrying")):
        entry = {"ts": ts, "from": src, "to": dst, "attempt": 1, "worker_id": "worker-00000000"}
        await r.rpush(keys.history(task_id), json.dumps(entry))
    await r.zadd(keys.retry_schedule(task.queue), {task_id: due_ms})


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"scheduler_interval_s": 0.05})


@pytest.fixture
def scheduler(queue: Queue, settings: Settings) -> Scheduler:
    return Scheduler(queue.store, settings, WORKER_A)


# -- the sweep ------------------------------------------------------------------------------------


async def test_delayed_task_expires_at_its_deadline_before_it_is_due(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    task = await queue.submit(
        "send_reminder", {"user_id": "123"}, delay_seconds=30, ttl_seconds=0.5, idempotency_key="r1"
    )
    assert task.status is TaskStatus.PENDING and task.expires_at is not None
    async with Events(r) as events, running(scheduler):
        await wait_until(reaches(queue, task.task_id, TaskStatus.EXPIRED))
        await asyncio.sleep(0.1)
    done = await queue.get(task.task_id)
    assert done.expired_at is not None and done.expires_at == task.expires_at
    assert timedelta(0) <= done.expired_at - task.expires_at < timedelta(seconds=2)
    assert done.attempt == 0 and done.started_at is None
    await assert_nothing_left(r, task)
    assert path(await queue.history(task.task_id)) == [(None, "pending"), ("pending", "expired")]
    idem = json.loads(await r.get(keys.idempotency("default", "r1")))
    assert idem["state"] == "failed" and idem["task_id"] == task.task_id
    [event] = events.of("TASK_EXPIRED", task.task_id)
    assert event.metadata["reason"] == "ttl"
    assert events.of("TASK_QUEUED", task.task_id) == []  # never promoted


async def test_queued_task_on_a_queue_no_worker_serves_expires(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    task = await queue.submit("process_event", {}, queue=UNSERVED, priority=3, ttl_seconds=0.5)
    assert task.status is TaskStatus.QUEUED
    assert await r.xlen(keys.stream(UNSERVED, 3)) == 1
    async with running(scheduler):
        await wait_until(reaches(queue, task.task_id, TaskStatus.EXPIRED))
    done = await queue.get(task.task_id)
    assert done.expired_at is not None and task.expires_at is not None
    assert timedelta(0) <= done.expired_at - task.expires_at < timedelta(seconds=2)
    assert await r.xlen(keys.stream(UNSERVED, 3)) == 0  # its entry is gone from the stream
    await assert_nothing_left(r, task)
    assert path(await queue.history(task.task_id)) == [(None, "queued"), ("queued", "expired")]


async def test_sweep_drains_more_than_one_batch_per_tick(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    n = 250
    tasks = await queue.submit_many(
        [{"task_type": "quick_task", "payload": {"i": i}} for i in range(n)],
        queue=UNSERVED,
        ttl_seconds=0.2,
    )
    assert await r.zcard(keys.expiry(UNSERVED)) == n
    await asyncio.sleep(0.25)
    result = await scheduler.tick()
    assert result.swept and len(result.expired) == n
    assert await r.zcard(keys.expiry(UNSERVED)) == 0
    assert await r.xlen(keys.stream(UNSERVED, 5)) == 0
    ids = [t.task_id for t in tasks if isinstance(t, Task)]
    assert len(ids) == n
    assert {t.status for t in await queue.store.get_many(ids)} == {TaskStatus.EXPIRED}


async def test_sweep_cut_by_its_time_budget_goes_on_at_the_next_tick(
    queue: Queue, r: Redis, scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog larger than one tick's budget: each tick stops after a batch once the budget
    is spent, and the next tick sweeps again at once instead of a second later."""
    monkeypatch.setattr(scheduler_module, "PHASE_BUDGET_S", 0.0)
    n = 250
    await queue.submit_many(
        [{"task_type": "quick_task", "payload": {"i": i}} for i in range(n)],
        queue=UNSERVED,
        ttl_seconds=0.2,
    )
    await asyncio.sleep(0.25)
    sizes = []
    for _ in range(3):
        result = await scheduler.tick()
        assert result.swept
        sizes.append(len(result.expired))
    assert sizes == [100, 100, 50]
    assert await r.zcard(keys.expiry(UNSERVED)) == 0


async def test_running_task_is_never_expired(queue: Queue, r: Redis, scheduler: Scheduler) -> None:
    """Expiration during execution: a started task runs to completion whatever its deadline."""
    task = await queue.submit("process", {}, queue=UNSERVED, ttl_seconds=0.1)
    await r.hset(keys.task(task.task_id), mapping={"status": "running", "attempt": 1})
    await asyncio.sleep(0.15)
    result = await scheduler.tick()
    assert result.expired == []
    assert (await queue.get(task.task_id)).status is TaskStatus.RUNNING
    assert await r.zscore(keys.expiry(UNSERVED), task.task_id) is None  # nothing left to look at
    assert await r.xlen(keys.stream(UNSERVED, 5)) == 1  # its consumer ACKs it when it finishes


async def test_extended_deadline_is_rescored_not_expired(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    """A reschedule that extended expires_at: the sweep finds the old score, sees the new
    deadline in the hash, and files the member under the new one."""
    task = await queue.submit("process", {}, delay_seconds=30, ttl_seconds=0.1)
    later = await redis_time_ms(r) + 60_000
    await r.hset(keys.task(task.task_id), "expires_at_ms", later)
    await asyncio.sleep(0.15)
    result = await scheduler.tick()
    assert result.expired == []
    assert (await queue.get(task.task_id)).status is TaskStatus.PENDING
    assert await r.zscore(keys.expiry("default"), task.task_id) == later


# -- retries and expiration -----------------------------------------------------------------------


async def test_retrying_task_past_its_deadline_is_swept_via_queued(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    task = await queue.submit("flaky_task", {}, ttl_seconds=0.5, max_attempts=3)
    # The retry is due long after the deadline: the task had its chance.
    await make_retrying(r, queue, task.task_id, await redis_time_ms(r) + 30_000)
    async with Events(r) as events, running(scheduler):
        await wait_until(reaches(queue, task.task_id, TaskStatus.EXPIRED))
        await asyncio.sleep(0.1)
    done = await queue.get(task.task_id)
    assert done.expired_at is not None and task.expires_at is not None
    assert done.expired_at - task.expires_at < timedelta(seconds=2)
    history = await queue.history(task.task_id)
    assert path(history) == [
        (None, "queued"),
        ("queued", "running"),
        ("running", "retrying"),
        ("retrying", "queued"),
        ("queued", "expired"),
    ]
    assert [h.attempt for h in history[-2:]] == [1, 1]
    await assert_nothing_left(r, task)
    assert len(events.of("TASK_EXPIRED", task.task_id)) == 1
    assert events.of("TASK_RETRIED", task.task_id) == []


async def test_retry_due_after_the_deadline_expires_at_promotion(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    """The expiry member was dropped while the task ran; the retry comes due after the
    deadline: promote expires it instead of queueing it."""
    task = await queue.submit("flaky_task", {}, ttl_seconds=0.1, max_attempts=3)
    await make_retrying(r, queue, task.task_id, await redis_time_ms(r) + 150)
    await r.zrem(keys.expiry("default"), task.task_id)
    await asyncio.sleep(0.2)
    result = await scheduler.tick()
    assert result.claimed == 1 and result.expired == [task.task_id] and result.retried == []
    assert (await queue.get(task.task_id)).status is TaskStatus.EXPIRED
    assert path(await queue.history(task.task_id))[-2:] == [
        ("retrying", "queued"),
        ("queued", "expired"),
    ]
    await assert_nothing_left(r, task)


async def test_retry_keeps_expires_at_and_expires_later_if_not_run(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    task = await queue.submit("flaky_task", {}, queue=UNSERVED, ttl_seconds=1.0, max_attempts=3)
    await make_retrying(r, queue, task.task_id, await redis_time_ms(r) - 1)
    await r.zrem(keys.expiry(UNSERVED), task.task_id)  # as the sweep leaves a task that was running
    result = await scheduler.tick()
    assert result.retried == [task.task_id]
    queued = await queue.get(task.task_id)
    assert queued.status is TaskStatus.QUEUED and queued.expires_at == task.expires_at
    assert queued.expires_at is not None
    # Promote filed the deadline again, so the sweep still finds the waiting retry.
    assert (
        await r.zscore(keys.expiry(UNSERVED), task.task_id) == queued.expires_at.timestamp() * 1000
    )
    async with running(scheduler):
        await wait_until(reaches(queue, task.task_id, TaskStatus.EXPIRED))
    await assert_nothing_left(r, task)


# -- scheduling plus expiration -------------------------------------------------------------------


async def test_scheduled_for_5pm_expiring_at_6pm(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    """The seed's meeting reminder, shrunk: runnable at "5pm", worthless after "6pm"."""
    now = await queue.now()
    five_pm, six_pm = now + timedelta(seconds=0.5), now + timedelta(seconds=1.5)
    task = await queue.submit(
        "meeting_reminder", {}, queue=UNSERVED, schedule_at=five_pm, expires_at=six_pm
    )
    assert task.status is TaskStatus.PENDING
    assert abs(task.available_at - five_pm) < timedelta(milliseconds=2)
    async with running(scheduler):
        await wait_until(reaches(queue, task.task_id, TaskStatus.QUEUED))
        queued_at = await queue.now()
        assert five_pm <= queued_at < six_pm
        assert await r.xlen(keys.stream(UNSERVED, 5)) == 1
        # Nobody ran it by 6pm: it expires, its entry leaves the stream.
        await wait_until(reaches(queue, task.task_id, TaskStatus.EXPIRED))
    done = await queue.get(task.task_id)
    assert done.expired_at is not None
    assert timedelta(0) <= done.expired_at - six_pm < timedelta(seconds=2)
    assert path(await queue.history(task.task_id)) == [
        (None, "pending"),
        ("pending", "queued"),
        ("queued", "expired"),
    ]
    await assert_nothing_left(r, task)


async def test_scheduled_after_its_deadline_never_queues(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    now = await queue.now()
    task = await queue.submit(
        "meeting_reminder",
        {},
        schedule_at=now + timedelta(seconds=1),
        expires_at=now + timedelta(seconds=0.4),
    )
    async with running(scheduler):
        await wait_until(reaches(queue, task.task_id, TaskStatus.EXPIRED))
        await asyncio.sleep(1.0)  # past the schedule time: nothing is promoted
    assert path(await queue.history(task.task_id)) == [(None, "pending"), ("pending", "expired")]
    await assert_nothing_left(r, task)


# -- zero TTL, no expiration, cancellation --------------------------------------------------------


async def test_zero_ttl_is_accepted_already_expired(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    task = await queue.submit("quick_task", {}, ttl_seconds=0)
    assert task.status is TaskStatus.EXPIRED
    assert (await scheduler.tick()).expired == []
    await assert_nothing_left(r, task)


async def test_no_expiration_by_default(queue: Queue, r: Redis, scheduler: Scheduler) -> None:
    task = await queue.submit("quick_task", {}, queue=UNSERVED, delay_seconds=0.05)
    assert task.expires_at is None and await r.zcard(keys.expiry(UNSERVED)) == 0
    async with running(scheduler):
        await wait_until(reaches(queue, task.task_id, TaskStatus.QUEUED))
        await asyncio.sleep(0.3)
    stored = await queue.get(task.task_id)
    assert stored.status is TaskStatus.QUEUED and stored.expires_at is None
    assert await r.zcard(keys.expiry(UNSERVED)) == 0


async def test_cancellation_versus_expiration(queue: Queue, r: Redis, scheduler: Scheduler) -> None:
    cancelled = await queue.submit("quick_task", {}, delay_seconds=30, ttl_seconds=0.1)
    await queue.cancel(cancelled.task_id)
    assert await r.zscore(keys.expiry("default"), cancelled.task_id) is None
    expired = await queue.submit("quick_task", {}, delay_seconds=30, ttl_seconds=0.1)
    await asyncio.sleep(0.15)
    result = await scheduler.tick()
    assert result.expired == [expired.task_id]
    # Terminal is terminal: an expired task cannot be cancelled, a cancelled one not expired.
    with pytest.raises(TaskTerminalError, match="expired"):
        await queue.cancel(expired.task_id)
    with pytest.raises(InvalidTransitionError, match="cancelled"):
        await queue.mark_expired(cancelled.task_id)
    assert (await queue.get(cancelled.task_id)).status is TaskStatus.CANCELLED
    assert (await queue.get(expired.task_id)).status is TaskStatus.EXPIRED


async def test_stale_expiry_member_of_a_finished_task_is_dropped(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    task = await queue.submit("quick_task", {}, delay_seconds=30)
    await queue.cancel(task.task_id)
    gone = calls.new_task_id("default")  # the queue's slot on a cluster
    await r.zadd(keys.expiry("default"), {task.task_id: 1, gone: 1})  # finished, and hash gone
    result = await scheduler.tick()
    assert result.expired == [] and await r.zcard(keys.expiry("default")) == 0


# -- the one clock --------------------------------------------------------------------------------


@pytest.mark.parametrize("offset_s", [3600, -3600])
async def test_a_process_clock_off_by_an_hour_changes_nothing(
    queue: Queue, r: Redis, scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch, offset_s: int
) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + offset_s)
    delayed = await queue.submit("quick_task", {}, queue=UNSERVED, delay_seconds=0.5)
    doomed = await queue.submit("quick_task", {}, queue=UNSERVED, delay_seconds=30, ttl_seconds=0.5)
    async with running(scheduler):
        await wait_until(reaches(queue, delayed.task_id, TaskStatus.QUEUED))
        await wait_until(reaches(queue, doomed.task_id, TaskStatus.EXPIRED))
    promoted = (await queue.history(delayed.task_id))[-1]
    # Not early (+1 h would have promoted at once), not late (-1 h would never have).
    lag = promoted.ts - delayed.available_at
    assert timedelta(0) <= lag < timedelta(seconds=1)
    done = await queue.get(doomed.task_id)
    assert done.expired_at is not None and doomed.expires_at is not None
    assert timedelta(0) <= done.expired_at - doomed.expires_at < timedelta(seconds=2)
    assert abs(done.expired_at - ms_to_dt(await redis_time_ms(r))) < timedelta(seconds=5)
