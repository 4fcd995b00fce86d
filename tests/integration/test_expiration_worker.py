"""Expiration end to end with a real worker (docs/expiration.md): a task that was delayed, ran,
failed and was retried past its deadline expires instead of running again; a task whose deadline
passes while its handler runs completes."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from redis.asyncio import Redis

from dtq import Queue, TaskStatus, keys
from dtq.config import Settings
from dtq_tasks import RetryableError, TaskContext
from support import running_worker
from support.worker import fast, handlers, past_deadline, wait_status

pytestmark = pytest.mark.backends("single", "cluster")


async def test_delayed_retried_then_expired_history(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    calls: list[int] = []

    async def fails_once(payload: dict[str, object], ctx: TaskContext) -> None:
        calls.append(ctx.attempt)
        raise RetryableError("try again later")

    # The retry is due 3 s (+-20 %) after the failure; the deadline falls before it.
    cfg = fast(settings, retry_base_delay=3.0, retry_max_delay=3.0)
    now = await queue.now()
    task = await queue.submit(
        "fails_once",
        {},
        delay_seconds=0.3,
        expires_at=now + timedelta(seconds=1.5),
        max_attempts=3,
    )
    async with running_worker(cfg, handlers(fails_once=fails_once)):
        h = await wait_status(r, task.task_id, "expired", timeout_s=10)

    assert calls == [1], "the handler ran once: the retry was due after the deadline"
    history = await queue.history(task.task_id)
    steps = [(e.from_status, e.to_status) for e in history]
    S = TaskStatus
    assert steps == [
        (None, S.PENDING),
        (S.PENDING, S.QUEUED),
        (S.QUEUED, S.RUNNING),
        (S.RUNNING, S.RETRYING),
        (S.RETRYING, S.QUEUED),
        (S.QUEUED, S.EXPIRED),
    ]
    assert [e.attempt for e in history[2:4]] == [1, 1]
    assert history[3].details["retry_delay_ms"] > 0
    assert [e.ts for e in history] == sorted(e.ts for e in history)
    final = await queue.get(task.task_id)
    assert final.expired_at is not None and final.expires_at is not None
    assert final.expired_at >= final.expires_at
    assert h["attempt"] == "1"
    # Index cleanup: nothing of the task is left in the schedule, the claims or the index.
    assert await r.zscore(keys.retry_schedule("default"), task.task_id) is None
    assert await r.zscore(keys.retry_claimed("default"), task.task_id) is None
    assert await r.zscore(keys.expiry("default"), task.task_id) is None


async def test_deadline_passing_during_execution_lets_the_task_finish(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    release = asyncio.Event()

    async def slow(payload: dict[str, object], ctx: TaskContext) -> str:
        await release.wait()
        return "done"

    async with running_worker(fast(settings), handlers(slow=slow)):
        # Submitted once the worker serves the queue, so it starts well within its 0.5 s.
        task = await queue.submit("slow", {}, ttl_seconds=0.5)
        await wait_status(r, task.task_id, "running")
        # Let the deadline pass (on the Redis clock) while the handler runs, and a sweep go by.
        assert task.expires_at is not None
        await past_deadline(queue, task.expires_at + timedelta(milliseconds=300))
        assert (await queue.get(task.task_id)).status == TaskStatus.RUNNING
        release.set()
        await wait_status(r, task.task_id, "succeeded")
    final = await queue.get(task.task_id)
    assert final.result == "done" and final.expired_at is None
