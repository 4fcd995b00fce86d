"""Sync handlers are stopped at their deadline, and two attempts of one task never overlap
(docs/delivery-guarantees.md, "Sync handlers"): a handler's thread is interrupted at its
``timeout_ms`` or on a cancel (an asynchronous exception), and the attempt is recorded, and so
the next one started, only once that thread has ended. Each handler records its thread's start
and end (monotonic clock of this process) per attempt in a Redis list."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
import redis
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq.errors import TaskRunningError
from dtq.worker.handlers import INTERRUPT_GRACE_S
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.cli import Cli
from support.worker import fast, handlers, read_as, start_as, wait_status

RUN_S = 4.0  # how long the handlers below run when nothing stops them
CLEANUP_S = 0.2  # how long they take to clean up once stopped: the worker must wait for it


def _runs_key(task_id: str) -> str:
    return f"test:runs:{task_id}"


def _looping(redis_url: str, *, swallow: bool = False) -> Any:
    """A sync handler looping in Python for RUN_S, then cleaning up for CLEANUP_S; ``swallow``:
    it catches the interrupt and goes on (badly behaved)."""

    def handler(payload: dict[str, Any], ctx: TaskContext) -> str:
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        key = _runs_key(ctx.task_id)
        r.rpush(key, f"start:{ctx.attempt}:{time.monotonic()}")
        try:
            until = time.monotonic() + RUN_S
            while time.monotonic() < until:
                try:
                    time.sleep(0.01)
                except TimeoutError:
                    if not swallow:
                        raise
                    r.rpush(key, f"caught:{ctx.attempt}:{time.monotonic()}")
            return "done"
        finally:
            time.sleep(CLEANUP_S)
            r.rpush(key, f"end:{ctx.attempt}:{time.monotonic()}")
            r.close()

    return handler


async def _runs(r: Redis, task_id: str) -> list[tuple[str, int, float]]:
    out = []
    for item in await r.lrange(_runs_key(task_id), 0, -1):
        what, attempt, at = item.split(":")
        out.append((what, int(attempt), float(at)))
    return out


def _spans(runs: list[tuple[str, int, float]]) -> dict[int, tuple[float, float | None]]:
    """attempt -> (thread start, thread end or None)."""
    spans: dict[int, tuple[float, float | None]] = {}
    for what, attempt, at in runs:
        if what == "start":
            spans[attempt] = (at, None)
        elif what == "end":
            spans[attempt] = (spans[attempt][0], at)
    return spans


async def test_timed_out_sync_handler_is_interrupted_and_its_retry_starts_after_it_ended(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    task = await queue.submit("tl_loop", {}, timeout_ms=300, max_attempts=2)
    async with running_worker(fast(settings), handlers(tl_loop=_looping(redis_url))):
        h = await wait_status(r, task.task_id, "dead_lettered", timeout_s=10)
    spans = _spans(await _runs(r, task.task_id))
    assert sorted(spans) == [1, 2]
    for attempt, (began, ended) in spans.items():
        assert ended is not None, f"the task ended while attempt {attempt}'s thread still ran"
        # Interrupted at its deadline, within a small margin (the loop sleeps 10 ms at a time).
        assert 0.25 + CLEANUP_S <= ended - began < 0.3 + CLEANUP_S + 0.5, (attempt, ended - began)
    assert spans[2][0] >= spans[1][1]  # type: ignore[operator]
    # Recorded as before: a timeout, retryable.
    assert h["error_class"] == "TimeoutError" and h["retryable"] == "1"
    assert h["error_message"] == "handler exceeded timeout_ms=300"
    assert h["attempt"] == "2"


async def test_cancel_interrupts_a_running_sync_handler_cancelled_after_it_ended(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    task = await queue.submit("tl_loop", {}, timeout_ms=30_000)
    async with running_worker(fast(settings), handlers(tl_loop=_looping(redis_url))):

        async def running() -> bool:
            return bool(await _runs(r, task.task_id))

        await wait_until(running, 5, "handler started")
        asked = time.monotonic()
        with pytest.raises(TaskRunningError):
            await queue.cancel(task.task_id)
        await wait_status(r, task.task_id, "cancelled", timeout_s=CLEANUP_S + 2)
        spans = _spans(await _runs(r, task.task_id))  # read at once: the thread has ended
    assert list(spans) == [1]
    ended = spans[1][1]
    assert ended is not None, "CANCELLED while the thread still ran"
    assert ended - asked < CLEANUP_S + 1.0
    assert (await queue.get(task.task_id)).result is None


async def test_handler_swallowing_the_interrupt_keeps_its_task_running_and_owned(
    settings: Settings, r: Redis, queue: Queue, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dtq.worker.worker")
    task = await queue.submit("tl_stubborn", {}, timeout_ms=300, max_attempts=2)
    s = fast(settings)  # visibility timeout 1.5 s: RUN_S outlasts it twice over
    worker_id = "tl-owner"

    async def pinned_until(seconds: float) -> bool:
        """Assert, until ``seconds`` have passed or the thread has ended, that the task is
        RUNNING its first attempt, its entry owned by the worker; True once it has ended."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            spans = _spans(await _runs(r, task.task_id))
            assert list(spans) == [1], f"a second attempt started: {spans}"
            if spans[1][1] is not None:
                return True
            h = await r.hgetall(keys.task(task.task_id))
            assert h["status"] == "running" and h["attempt"] == "1", h
            [pending] = await r.xpending_range(
                keys.stream("default", 5), keys.CONSUMER_GROUP, "-", "+", 1
            )
            assert pending["consumer"] == worker_id
            await asyncio.sleep(0.1)
        return False

    async with running_worker(
        s, handlers(tl_stubborn=_looping(redis_url, swallow=True)), worker_id=worker_id
    ):

        async def started() -> bool:
            return bool(await _runs(r, task.task_id))

        await wait_until(started, 5, "handler started")
        assert not await pinned_until(0.3 + INTERRUPT_GRACE_S)
        assert [what for what, _, _ in await _runs(r, task.task_id)] == ["start", "caught"]

        async def noted() -> bool:  # the overdue thread is reported, and named in the hash
            return await r.hget(keys.task(task.task_id), "overdue_attempt") == "1"

        await wait_until(noted, 2, "overdue attempt noted")
        assert "still runs" in caplog.text
        with pytest.raises(TaskRunningError) as refused:
            await queue.cancel(task.task_id)
        # The cancel says its worker cannot stop it.
        assert refused.value.details["overdue_attempt"] == 1
        assert "cannot stop it" in refused.value.message
        # Past the visibility timeout: still RUNNING, still this worker's, no second attempt.
        assert await pinned_until(RUN_S + 2)
        assert "cancel requested after its sync handler timed out" in caplog.text
        await wait_status(r, task.task_id, "cancelled", timeout_s=2)
    spans = _spans(await _runs(r, task.task_id))
    assert list(spans) == [1]
    began, ended = spans[1]
    assert ended is not None and ended - began >= RUN_S


async def test_shutdown_interrupts_a_sync_handler_and_leaves_its_entry_for_a_peer(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    task = await queue.submit("tl_loop", {}, timeout_ms=30_000)
    s = fast(settings, drain_timeout_s=0.3)
    async with running_worker(s, handlers(tl_loop=_looping(redis_url))) as w:

        async def running() -> bool:
            return bool(await _runs(r, task.task_id))

        await wait_until(running, 5, "handler started")
        w.stop()
        stopped_at = time.monotonic()
    # The worker stopped within its drain timeout and the grace, its thread has ended, and
    # nothing was recorded: the entry is pending for a peer (a crash redelivery).
    assert time.monotonic() - stopped_at < 0.3 + INTERRUPT_GRACE_S + 3
    spans = _spans(await _runs(r, task.task_id))
    assert spans[1][1] is not None, "the thread still ran after the worker stopped"
    assert spans[1][1] < time.monotonic()
    h = await r.hgetall(keys.task(task.task_id))
    assert h["status"] == "running"
    pending = await r.xpending(keys.stream("default", 5), keys.CONSUMER_GROUP)
    assert pending["pending"] == 1
    async with running_worker(s, handlers(tl_loop=_looping(redis_url))):
        h = await wait_status(r, task.task_id, "succeeded", timeout_s=RUN_S + 6)
    assert h["attempt"] == "2"


async def test_shutdown_stops_waiting_for_a_timed_out_thread_that_runs_on(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    task = await queue.submit("tl_stubborn", {}, timeout_ms=300, max_attempts=2)
    s = fast(settings, drain_timeout_s=0.5)
    async with running_worker(s, handlers(tl_stubborn=_looping(redis_url, swallow=True))) as w:

        async def started() -> bool:
            return bool(await _runs(r, task.task_id))

        async def caught() -> bool:  # past its deadline: the finish waits for the thread
            return any(what == "caught" for what, _, _ in await _runs(r, task.task_id))

        await wait_until(caught, 5, "interrupt caught")
        w.stop()
        stopped_at = time.monotonic()
    # The drain timeout bounds the wait: the worker stopped while the thread still ran, and
    # recorded nothing; the entry is left for a peer.
    assert time.monotonic() - stopped_at < RUN_S
    assert _spans(await _runs(r, task.task_id))[1][1] is None
    h = await r.hgetall(keys.task(task.task_id))
    assert h["status"] == "running" and h["attempt"] == "1"
    pending = await r.xpending(keys.stream("default", 5), keys.CONSUMER_GROUP)
    assert pending["pending"] == 1

    async def thread_ended() -> bool:  # in this process the thread runs on: let it end
        return _spans(await _runs(r, task.task_id))[1][1] is not None

    await wait_until(thread_ended, RUN_S + 2, "the stubborn thread ended")


async def test_cancel_of_a_task_whose_thread_runs_on_says_its_worker_cannot_stop_it(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    """The worker names the attempt whose thread did not stop (``overdue_attempt``); a cancel
    says so while that attempt runs, by the SDK (and the API: the error's details) and the CLI.
    A note left by an earlier attempt says nothing."""
    task = await queue.submit("tl_loop", {})
    entry = await read_as(r, "tl-worker")
    await start_as(r, entry, "tl-worker", settings)  # RUNNING, attempt 1
    await r.hset(keys.task(task.task_id), "overdue_attempt", "1")
    with pytest.raises(TaskRunningError) as refused:
        await queue.cancel(task.task_id)
    assert refused.value.details["overdue_attempt"] == 1
    assert "its worker cannot stop it" in refused.value.message
    run = await asyncio.to_thread(Cli(redis_url).ok, "cancel", task.task_id)
    assert "its worker cannot stop it" in run.out
    await r.hset(keys.task(task.task_id), "overdue_attempt", "0")  # another attempt's
    with pytest.raises(TaskRunningError) as plain:
        await queue.cancel(task.task_id)
    assert "overdue_attempt" not in plain.value.details
    run = await asyncio.to_thread(Cli(redis_url).ok, "cancel", task.task_id)
    assert "cannot stop it" not in run.out and "cancellation requested" in run.out
