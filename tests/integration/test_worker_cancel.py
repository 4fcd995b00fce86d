"""Cancellation (contract section 6): a queued task never runs; a running one is CANCELLED
within a second of the request (an async handler is cancelled; a sync handler's thread is
interrupted, and the task is CANCELLED once that thread has ended: one blocked in C code runs on
until it returns, its slot taken, its task RUNNING)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq.errors import TaskRunningError
from dtq_tasks import TaskCancelled, TaskContext
from support import Events, running_worker, wait_until
from support.worker import fast, handlers, wait_status


async def test_running_async_task_is_cancelled_within_one_second(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    started = asyncio.Event()
    outcome: list[str] = []

    async def forever(payload: dict[str, Any], ctx: TaskContext) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    task = await queue.submit("wt_forever", {}, idempotency_key="k-c")
    async with (
        Events(r) as events,
        running_worker(fast(settings), handlers(wt_forever=forever)),
    ):
        await asyncio.wait_for(started.wait(), 5)
        asked = time.monotonic()
        with pytest.raises(TaskRunningError):
            await queue.cancel(task.task_id)
        h = await wait_status(r, task.task_id, "cancelled", timeout_s=1.0)
        assert time.monotonic() - asked < 1.0
        await wait_until(lambda: _has(events, task.task_id), 2, "TASK_CANCELLED")
    assert outcome == ["cancelled"]
    assert h["finished_at"] and h["cancel_requested"] == "1"
    assert await r.xlen(keys.stream("default", 5)) == 0
    assert await r.get(keys.idempotency("default", "k-c")) is not None
    history = await queue.history(task.task_id)
    assert (history[-1].from_status, history[-1].to_status) == ("running", "cancelled")


async def _has(events: Events, task_id: str) -> bool:
    return bool(events.of("TASK_CANCELLED", task_id))


async def test_running_thread_task_is_interrupted_and_cancelled_once_its_thread_ended(
    settings: Settings, r: Redis, queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dtq.worker.worker")
    release = threading.Event()
    entered = threading.Event()
    order: list[str] = []

    def blocking(payload: dict[str, Any], ctx: TaskContext) -> str:
        order.append(f"start:{payload['n']}")
        entered.set()
        try:
            release.wait(10)  # C code: the interrupt is raised once it returns
        except TaskCancelled:
            order.append(f"interrupted:{payload['n']}")
            raise
        order.append(f"end:{payload['n']}")
        return "late result"

    first = await queue.submit("wt_block", {"n": 1})
    async with running_worker(fast(settings), handlers(wt_block=blocking), concurrency=1):
        await asyncio.to_thread(entered.wait, 5)
        second = await queue.submit("wt_block", {"n": 2})
        with pytest.raises(TaskRunningError):
            await queue.cancel(first.task_id)

        async def stopping() -> bool:
            return "cancel requested, stopping its handler" in caplog.text

        await wait_until(stopping, 2, "cancel acted on")
        # The thread still runs (blocked in C): the task stays RUNNING, and the thread holds
        # the only slot, so the second task waits.
        assert (await queue.get(first.task_id)).status == "running"
        assert (await queue.get(second.task_id)).status == "queued"
        assert order == ["start:1"]
        release.set()
        await wait_status(r, first.task_id, "cancelled", timeout_s=2)
        await wait_status(r, second.task_id, "succeeded")
    done = await queue.get(first.task_id)
    assert done.status == "cancelled" and done.result is None
    assert order[:2] == ["start:1", "interrupted:1"]


async def test_queued_task_cancelled_never_runs(settings: Settings, r: Redis, queue: Queue) -> None:
    ran: list[str] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(ctx.task_id)

    cancelled = await queue.submit("wt_rec", {})
    await queue.cancel(cancelled.task_id)
    kept = await queue.submit("wt_rec", {})
    async with running_worker(fast(settings), handlers(wt_rec=record)):
        await wait_status(r, kept.task_id, "succeeded")
    assert ran == [kept.task_id]
    assert (await queue.get(cancelled.task_id)).status == "cancelled"


async def test_failure_after_cancel_request_is_cancelled_not_retried(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """A handler that swallows the cancellation and fails: the request still stands."""
    started = asyncio.Event()

    async def stubborn(payload: dict[str, Any], ctx: TaskContext) -> None:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, against the rules
            await asyncio.sleep(60)
        raise TimeoutError("gave up")

    task = await queue.submit("wt_stubborn", {}, max_attempts=3)
    async with running_worker(fast(settings), handlers(wt_stubborn=stubborn)):
        await asyncio.wait_for(started.wait(), 5)
        with pytest.raises(TaskRunningError):
            await queue.cancel(task.task_id)
        await wait_status(r, task.task_id, "cancelled", timeout_s=2.0)
    assert await r.zscore(keys.RETRY_SCHEDULE, task.task_id) is None
