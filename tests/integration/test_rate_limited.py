"""Back-pressure from a handler (docs/limits.md, "Back-pressure from a handler"), against real
servers: ``raise RateLimited(retry_after_s)`` or ``ctx.rate_limited(...)`` parks the task
PENDING without spending its attempt, due ``retry_after_s`` later on the Redis clock; it gives
its limit places back; ``slow=True`` holds the limits it met (a per-key limit: its key only);
a cancel requested while it ran cancels it; its deadline still applies; a bad ``retry_after_s``
is the handler's error.

Times are read on the Redis clock, from the task's history and hash, never from sleeps."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import datetime
from typing import Any

import pytest
from redis.asyncio import Redis

import dtq.worker.worker as worker_module
from dtq import Queue, RateLimited, TaskStatus, keys
from dtq.config import Settings
from dtq.connection import no_retry
from dtq.errors import TaskRunningError
from dtq.limits import LimitDef
from dtq.models import HistoryEntry, parse_ts
from dtq.scripts import Scripts
from dtq.worker import Worker
from dtq.worker.observer import TaskFinished, TaskStarted, WorkerObserver
from dtq_tasks import HandlerError, TaskContext
from support import Events, running_worker, started, wait_until
from support.wire import LosingConnection, losing_client, reset
from support.worker import fast, handlers, pushed_back_once

pytestmark = pytest.mark.backends("single", "cluster")


async def define(r: Redis, name: str, **fields: Any) -> None:
    d = LimitDef.parse(fields)
    await r.hset(keys.limits(d.queue), name, d.to_json())


async def status_is(queue: Queue, task_id: str, status: str) -> bool:
    return (await queue.get(task_id)).status == status


def steps(history: list[HistoryEntry]) -> list[tuple[str | None, str, str | None]]:
    return [(h.from_status, h.to_status, h.reason) for h in history]


def ms(ts: datetime) -> int:
    return round(ts.timestamp() * 1000)


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_an_attempt_rate_limited_three_times_is_not_spent(
    queue: Queue, settings: Settings, r: Redis, kind: str
) -> None:
    """max_attempts=1: pushed back three times (the exception, or ctx.rate_limited in a sync
    handler's thread), then run: SUCCEEDED at attempt 1, each park in the history."""
    calls: Counter[str] = Counter()

    async def pushed(payload: dict[str, Any], ctx: TaskContext) -> int:
        calls[ctx.task_id] += 1
        if calls[ctx.task_id] <= 3:
            raise RateLimited(retry_after_s=0.1)
        return ctx.attempt

    def pushed_sync(payload: dict[str, Any], ctx: TaskContext) -> int:
        calls[ctx.task_id] += 1
        if calls[ctx.task_id] <= 3:
            ctx.rate_limited(0.1)
        return ctx.attempt

    fn = pushed if kind == "async" else pushed_sync
    async with Events(r) as events, running_worker(fast(settings), handlers(call=fn)):
        task = await queue.submit("call", {}, max_attempts=1)
        assert await queue.result(task.task_id, timeout=30) == 1
        await events.sync()
    done = await queue.get(task.task_id)
    assert done.status == TaskStatus.SUCCEEDED and done.attempt == 1
    assert calls[task.task_id] == 4
    history = await queue.history(task.task_id)
    parks = [h for h in history if h.reason == "rate_limited"]
    assert len(parks) == 3
    assert all(h.from_status == "running" and h.to_status == "pending" for h in parks)
    assert all(h.attempt == 1 and h.details["retry_after_ms"] == 100 for h in parks)
    assert [h.attempt for h in history if h.to_status == "running"] == [1, 1, 1, 1]
    throttled = events.of("TASK_THROTTLED")
    assert len(throttled) == 3
    assert all(e.metadata["reason"] == "upstream" for e in throttled)
    assert all(
        e.metadata["retry_after_ms"] == 100 and e.metadata["slow"] is False for e in throttled
    )
    assert not await r.hexists(keys.task(task.task_id), "throttled_at_ms")  # the run took it


async def test_it_does_not_start_again_before_retry_after(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    pushed = pushed_back_once(RateLimited(1.0), then="ok")

    async with running_worker(fast(settings), handlers(call=pushed)):
        task = await queue.submit("call", {})
        await wait_until(lambda: status_is(queue, task.task_id, "pending"), 10, "parked")
        parked = await r.hgetall(keys.task(task.task_id))
        assert await queue.result(task.task_id, timeout=30) == "ok"
    history = await queue.history(task.task_id)
    at = next(i for i, h in enumerate(history) if h.reason == "rate_limited")
    park, restart = history[at], next(h for h in history[at:] if h.to_status == "running")
    due_ms = ms(parse_ts(parked["available_at"]))
    assert due_ms - ms(park.ts) == 1000  # due retry_after_s after the park, on the Redis clock
    assert parked["attempt"] == "0" and parked["throttled_at_ms"] == str(ms(park.ts))
    assert await r.zscore(keys.retry_schedule("default"), task.task_id) is None
    assert ms(restart.ts) >= due_ms  # never started before it was due
    assert (await queue.get(task.task_id)).started_at == restart.ts


async def test_slow_holds_the_key_it_met_and_only_that_key(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """slow=True under a per-key limit: another task of that key parks (upstream) until the
    hold ends; a task of another key runs at once."""
    await define(r, "per-tenant", task_type="call", key="payload.tenant", concurrency=5)
    pushed_back: set[str] = set()

    async def call(payload: dict[str, Any], ctx: TaskContext) -> str:
        if payload.get("push") and ctx.task_id not in pushed_back:
            pushed_back.add(ctx.task_id)
            ctx.rate_limited(2.0, slow=True)
        return payload["tenant"]

    rate_a = keys.limit_state("default", "per-tenant", "a") + ":rate"
    async with Events(r) as events, running_worker(fast(settings), handlers(call=call)):
        first = await queue.submit("call", {"tenant": "a", "push": True})
        await wait_until(lambda: status_is(queue, first.task_id, "pending"), 10, "parked")
        parked = await r.hgetall(keys.task(first.task_id))
        hold_ms = int(await r.hget(rate_a, "hold") or 0)
        assert hold_ms == ms(parse_ts(parked["available_at"]))
        assert 0 < await r.pttl(rate_a) <= 3000  # the state outlives the hold, then goes
        same = await queue.submit("call", {"tenant": "a"})
        other = await queue.submit("call", {"tenant": "b"})
        assert await queue.result(other.task_id, timeout=10) == "b"
        other_done = await queue.get(other.task_id)
        assert other_done.started_at is not None and ms(other_done.started_at) < hold_ms
        assert await queue.result(same.task_id, timeout=30) == "a"
        assert await queue.result(first.task_id, timeout=30) == "a"
        await events.sync()
    same_done = await queue.get(same.task_id)
    assert same_done.started_at is not None and ms(same_done.started_at) >= hold_ms
    assert same_done.attempt == 1
    held = [h for h in await queue.history(same.task_id) if h.reason == "throttled"]
    assert held and all(h.details["throttle"] == "upstream" for h in held)
    assert held[0].details["limit"] == "per-tenant"
    assert ms(parse_ts(held[0].details["until"])) == hold_ms
    reasons = {(e.task_id, e.metadata["reason"]) for e in events.of("TASK_THROTTLED")}
    assert (same.task_id, "upstream") in reasons and (first.task_id, "upstream") in reasons
    assert not [e for e in events.of("TASK_THROTTLED") if e.task_id == other.task_id]
    mine = [e for e in events.of("TASK_THROTTLED") if e.task_id == first.task_id]
    assert mine[0].metadata["slow"] is True and mine[0].metadata["retry_after_ms"] == 2000
    assert not await r.exists(keys.limit_state("default", "per-tenant", "b") + ":rate")


async def test_slow_with_no_limit_just_parks(queue: Queue, settings: Settings, r: Redis) -> None:
    call = pushed_back_once(RateLimited(0.2, slow=True))

    async with Events(r) as events, running_worker(fast(settings), handlers(call=call)):
        task = await queue.submit("call", {}, max_attempts=1)
        assert await queue.result(task.task_id, timeout=10) == 1
        await events.sync()
    park = [h for h in await queue.history(task.task_id) if h.reason == "rate_limited"]
    assert len(park) == 1 and park[0].details["slow"] is True  # what the handler asked
    (throttled,) = events.of("TASK_THROTTLED")
    assert throttled.metadata["slow"] is True


async def test_its_concurrency_place_is_given_back(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """The one place of a concurrency goes to the task parked for it as soon as the holder is
    pushed back (long before the parked task's own re-check)."""
    await define(r, "solo", task_type="call", concurrency=1)
    go = asyncio.Event()

    async def call(payload: dict[str, Any], ctx: TaskContext) -> str:
        if payload.get("push"):
            await go.wait()
            raise RateLimited(600)
        return "ran"

    running = keys.limit_state("default", "solo") + ":running"
    async with running_worker(fast(settings), handlers(call=call), concurrency=4):
        holder = await queue.submit("call", {"push": True})
        await wait_until(lambda: status_is(queue, holder.task_id, "running"), 10, "runs")
        assert await r.zrange(running, 0, -1) == [holder.task_id]
        waiter = await queue.submit("call", {})
        await wait_until(lambda: status_is(queue, waiter.task_id, "pending"), 10, "parked")
        go.set()
        assert await queue.result(waiter.task_id, timeout=10) == "ran"
        assert (await queue.get(holder.task_id)).status == TaskStatus.PENDING
        await queue.cancel(holder.task_id)  # parked for ten minutes: a pending task cancels
    assert await r.zcard(running) == 0
    assert (await queue.get(holder.task_id)).status == TaskStatus.CANCELLED


async def test_a_cancel_requested_while_it_ran_cancels_it(
    queue: Queue, settings: Settings, r: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler is pushed back after its cancel was requested (the worker's cancel poll is
    put off, so that it is finish.lua that sees the request): CANCELLED, not parked."""
    monkeypatch.setattr(worker_module, "CANCEL_POLL_S", 3600.0)

    async def call(payload: dict[str, Any], ctx: TaskContext) -> None:
        with pytest.raises(TaskRunningError):
            await queue.cancel(ctx.task_id)
        raise RateLimited(60)

    async with running_worker(fast(settings), handlers(call=call)):
        task = await queue.submit("call", {}, ttl_seconds=600)
        ended = await queue.wait(task.task_id, timeout=10)
    assert ended.status == TaskStatus.CANCELLED
    assert steps(await queue.history(task.task_id))[-1] == (
        "running",
        "cancelled",
        "cancel_requested",
    )
    assert await r.zscore(keys.retry_schedule("default"), task.task_id) is None
    assert await r.zscore(keys.expiry("default"), task.task_id) is None


async def test_a_parked_task_still_expires(queue: Queue, settings: Settings, r: Redis) -> None:
    async def call(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise RateLimited(600)

    async with running_worker(fast(settings), handlers(call=call)):
        task = await queue.submit("call", {}, ttl_seconds=1.5)
        await wait_until(lambda: status_is(queue, task.task_id, "pending"), 10, "parked")
        deadline = task.expires_at
        assert deadline is not None
        assert await r.zscore(keys.expiry("default"), task.task_id) == ms(deadline)
        ended = await queue.wait(task.task_id, timeout=15)
    assert ended.status == TaskStatus.EXPIRED
    assert steps(await queue.history(task.task_id))[-1][:2] == ("pending", "expired")


class Sneaky(RateLimited):
    """A subclass that skips RateLimited's own checks."""

    def __init__(self) -> None:
        HandlerError.__init__(self, "sneaky")
        self.retry_after_s = float("nan")
        self.slow = False


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (lambda: RateLimited(0), "retry_after_s must be a number more than 0"),
        (lambda: RateLimited(86401), "at most 86400"),
        (Sneaky, "not nan"),
    ],
    ids=["zero", "over-a-day", "subclass"],
)
async def test_a_bad_retry_after_is_the_handlers_error(
    queue: Queue, settings: Settings, raised: Any, expected: str
) -> None:
    async def call(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise raised()

    async with running_worker(fast(settings), handlers(call=call)):
        task = await queue.submit("call", {}, max_attempts=2)
        ended = await queue.wait(task.task_id, timeout=10)
    assert ended.status == TaskStatus.DEAD_LETTERED and ended.attempt == 1
    assert ended.error_class == "ValueError"
    assert ended.error_message is not None and expected in ended.error_message


class Finished(WorkerObserver):
    def __init__(self) -> None:
        self.statuses: list[str] = []
        self.throttled_ms: list[int | None] = []

    def task_started(self, event: TaskStarted) -> None:
        self.throttled_ms.append(event.throttled_ms)

    def task_finished(self, event: TaskFinished) -> None:
        self.statuses.append(event.status)


async def test_the_next_start_reports_the_park_as_a_throttle_wait(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """What dtq_throttle_wait_seconds observes: the start after the park carries how long the
    task was held back, from the park on the Redis clock."""
    call = pushed_back_once(RateLimited(0.3))

    seen = Finished()
    worker = Worker(fast(settings), handlers=handlers(call=call), observers=[seen])
    async with started(worker):
        task = await queue.submit("call", {}, max_attempts=1)
        assert await queue.result(task.task_id, timeout=15) == 1
    history = await queue.history(task.task_id)
    park = next(h for h in history if h.reason == "rate_limited")
    restart = [h for h in history if h.to_status == "running"][-1]
    assert seen.statuses == ["pending", "succeeded"]
    first, second = seen.throttled_ms
    assert first is None  # never parked before its first start
    assert second == ms(restart.ts) - ms(park.ts) and second >= 300


@pytest.mark.backends("single", reason="the reply is lost by a single server's client")
async def test_a_lost_reply_of_its_park_is_told_as_the_park(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """The reply of the finish that parked the task is lost on the wire: sent again, it is
    fenced (the task is PENDING), and the worker tells what the first one recorded (pending),
    then the success of the same attempt number that follows."""
    call = pushed_back_once(RateLimited(0.2))

    reset(killer=r)
    try:
        LosingConnection.lose_next_script_reply = True
        LosingConnection.lose_only = (Scripts().sha["finish"].encode(),)
        seen = Finished()
        client = losing_client(settings.redis_url, no_retry(), socket_timeout=10)
        worker = Worker(
            fast(settings), handlers=handlers(call=call), redis=client, observers=[seen]
        )
        async with started(worker):
            task = await queue.submit("call", {}, max_attempts=1)
            assert await queue.result(task.task_id, timeout=15) == 1

            async def told() -> bool:
                return len(seen.statuses) == 2

            await wait_until(told, 10, "both finishes told")
        assert not LosingConnection.lose_next_script_reply  # the park's reply was lost
    finally:
        reset()
    assert seen.statuses == ["pending", "succeeded"]
