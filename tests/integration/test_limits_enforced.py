"""Limits enforced in start.lua (docs/limits.md, "How a limit is enforced"), against real
servers: a concurrency is never exceeded, a rate spaces the starts, a throttled task is parked
without spending an attempt (max_attempts=1 tasks all succeed), per-key limits are per key,
priorities hold among parked tasks, a parked task can still be cancelled and still expires,
and a change of the definitions reaches a running worker within about a second.

The definitions are written where the workers read them (``keys.limits(queue)``), as the
SDK, the API and the CLI store them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, TaskStatus, keys
from dtq.config import Settings
from dtq.limits import LimitDef
from dtq_tasks import TaskContext
from support import Events, running_worker, wait_until
from support.worker import fast, handlers

pytestmark = pytest.mark.backends("single", "cluster")


async def define(r: Redis, name: str, **fields: Any) -> None:
    d = LimitDef.parse(fields)
    await r.hset(keys.limits(d.queue), name, d.to_json())


class Log:
    """The handlers' own side-effect log: (task id, start, end) on the monotonic clock."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []
        self.running = 0
        self.most = 0
        self.by_key: dict[str, int] = {}
        self.most_by_key: dict[str, int] = {}

    def handler(self, hold_s: float) -> Any:
        async def run(payload: dict[str, Any], ctx: TaskContext) -> int:
            key = str(payload.get("tenant", ""))
            self.running += 1
            self.by_key[key] = self.by_key.get(key, 0) + 1
            self.most = max(self.most, self.running)
            self.most_by_key[key] = max(self.most_by_key.get(key, 0), self.by_key[key])
            t0 = time.monotonic()
            try:
                await asyncio.sleep(hold_s)
            finally:
                self.running -= 1
                self.by_key[key] -= 1
                self.spans.append((ctx.task_id, t0, time.monotonic()))
            return ctx.attempt

        return run


async def all_end(queue: Queue, ids: list[str]) -> list[Any]:
    return await queue.wait_many(ids, timeout=60)


async def test_a_concurrency_is_never_exceeded_and_throttles_spend_no_attempt(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await define(r, "two-at-once", task_type="work", concurrency=2)
    log = Log()
    async with (
        Events(r) as events,
        running_worker(fast(settings), handlers(work=log.handler(0.1)), concurrency=8),
    ):
        ids = [(await queue.submit("work", {}, max_attempts=1)).task_id for _ in range(12)]
        ended = await all_end(queue, ids)
        await events.sync()
    assert all(t.status == TaskStatus.SUCCEEDED and t.result == 1 for t in ended)
    assert log.most == 2, log.most
    assert len(log.spans) == 12  # each ran once
    throttled = events.of("TASK_THROTTLED")
    assert throttled and all(e.metadata["limit"] == "two-at-once" for e in throttled)
    assert {e.metadata["reason"] for e in throttled} == {"concurrency"}
    # the places are all given back
    assert await r.zcard(keys.limit_state("default", "two-at-once") + ":running") == 0
    history = await queue.history(ids[-1])
    steps = [(h.from_status, h.to_status, h.reason) for h in history]
    if ("queued", "pending", "throttled") in steps:
        assert ("pending", "queued", "due") in steps


async def test_a_rate_spaces_the_starts(queue: Queue, settings: Settings, r: Redis) -> None:
    await define(r, "ten-a-second", task_type="work", rate="10/s")
    log = Log()
    async with running_worker(fast(settings), handlers(work=log.handler(0)), concurrency=8):
        ids = [(await queue.submit("work", {}, max_attempts=1)).task_id for _ in range(8)]
        ended = await all_end(queue, ids)
    starts = sorted(t.started_at.timestamp() for t in ended if t.started_at)  # Redis clock
    assert all(t.status == TaskStatus.SUCCEEDED and t.attempt == 1 for t in ended)
    # GCRA with a burst of 1: the k-th start is at least k intervals after the first (each
    # parked task starts at or after the slot it reserved; 1 ms: the clock's resolution).
    late = [starts[k] - starts[0] - k * 0.1 for k in range(len(starts))]
    assert min(late) >= -0.002, late


async def test_a_burst_lets_that_many_through_at_once(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await define(r, "bursty", task_type="work", rate="1/m", burst=3)
    log = Log()
    async with running_worker(fast(settings), handlers(work=log.handler(0)), concurrency=8):
        ids = [(await queue.submit("work", {}, max_attempts=1)).task_id for _ in range(5)]
        await wait_until(lambda: _count(log, 3), 10, "the burst ran")
        waiting = [await queue.get(t) for t in ids]
    assert sorted(t.status for t in waiting).count(TaskStatus.PENDING) == 2
    parked = [t for t in waiting if t.status == TaskStatus.PENDING]
    assert all(t.attempt == 0 for t in parked)  # parked before any attempt


async def _count(log: Log, n: int) -> bool:
    return len(log.spans) == n


async def test_a_keyed_limit_is_per_key(queue: Queue, settings: Settings, r: Redis) -> None:
    await define(r, "per-tenant", task_type="work", key="payload.tenant", concurrency=1)
    log = Log()
    async with running_worker(fast(settings), handlers(work=log.handler(0.1)), concurrency=8):
        ids = [
            (await queue.submit("work", {"tenant": tenant})).task_id
            for tenant in ("a", "b", "a", "b", "a", "b")
        ]
        await all_end(queue, ids)
    assert log.most_by_key == {"a": 1, "b": 1}
    assert log.most == 2  # the two tenants ran side by side


async def test_a_parked_task_can_be_cancelled_and_still_expires(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await define(r, "one", task_type="hold", concurrency=1)
    go = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        await go.wait()

    async with running_worker(fast(settings), handlers(hold=hold), concurrency=4):
        first = await queue.submit("hold", {})
        await wait_until(
            lambda: _status_is(queue, first.task_id, "running"), 10, "the first one runs"
        )
        second = await queue.submit("hold", {})
        third = await queue.submit("hold", {}, ttl_seconds=2)
        for t in (second, third):
            await wait_until(lambda t=t: _status_is(queue, t.task_id, "pending"), 10, "parked")
        await queue.cancel(second.task_id)
        assert (await queue.wait(third.task_id, timeout=15)).status == TaskStatus.EXPIRED
        go.set()
        assert (await queue.wait(first.task_id, timeout=15)).status == TaskStatus.SUCCEEDED
    assert (await queue.get(second.task_id)).status == TaskStatus.CANCELLED


async def _status_is(queue: Queue, task_id: str, status: str) -> bool:
    return (await queue.get(task_id)).status == status


async def test_a_change_reaches_a_running_worker(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """A definition put or deleted while the worker runs is applied (or dropped) by its next
    read of the definitions, every second (3 s allowed here for a loaded machine)."""
    log = Log()
    work = handlers(work=log.handler(0.05))
    async with running_worker(fast(settings), work, concurrency=8) as worker:

        async def applied(yes: bool) -> bool:
            return worker.execution.limits.empty is not yes

        await all_end(queue, [(await queue.submit("work", {})).task_id for _ in range(6)])
        assert log.most > 1  # no limit yet
        await define(r, "now-one", task_type="work", concurrency=1)
        await wait_until(lambda: applied(True), 3, "the worker read the new limit")
        log.most = 0
        await all_end(queue, [(await queue.submit("work", {})).task_id for _ in range(6)])
        assert log.most == 1
        await r.hdel(keys.limits("default"), "now-one")
        await wait_until(lambda: applied(False), 3, "the worker dropped the limit")
        log.most = 0
        await all_end(queue, [(await queue.submit("work", {})).task_id for _ in range(6)])
    assert log.most > 1


async def test_priorities_hold_among_parked_tasks(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await define(r, "serial", task_type="work", concurrency=1)
    order: list[int] = []
    go = asyncio.Event()

    async def work(payload: dict[str, Any], ctx: TaskContext) -> None:
        if payload["n"] == 0:
            await go.wait()
        order.append(payload["n"])

    async with running_worker(fast(settings), handlers(work=work), concurrency=4):
        first = await queue.submit("work", {"n": 0})
        await wait_until(lambda: _status_is(queue, first.task_id, "running"), 10, "runs")
        low = [await queue.submit("work", {"n": n}, priority=1) for n in (1, 2)]
        high = await queue.submit("work", {"n": 3}, priority=9)
        for t in (*low, high):
            await wait_until(lambda t=t: _status_is(queue, t.task_id, "pending"), 10, "parked")
        go.set()
        await all_end(queue, [first.task_id, high.task_id, *(t.task_id for t in low)])
    assert order[0] == 0 and order[1] == 3, order  # the high priority one takes the place


async def test_a_task_throttled_twenty_times_runs_at_attempt_one(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """A task kept out by a concurrency 20 times (made due again by hand each time, while the
    only place is held) then run: attempt 1, its history shows every throttle."""
    await define(r, "solo", task_type="hold", concurrency=1)
    go = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> int:
        if payload.get("first"):
            await go.wait()
        return ctx.attempt

    async def throttles(task_id: str) -> int:
        return sum(1 for h in await queue.history(task_id) if h.reason == "throttled")

    async with running_worker(fast(settings), handlers(hold=hold), concurrency=4):
        first = await queue.submit("hold", {"first": True})
        await wait_until(lambda: _status_is(queue, first.task_id, "running"), 10, "runs")
        task = await queue.submit("hold", {}, max_attempts=1)
        for n in range(1, 21):

            async def parked(n: int = n) -> bool:
                return await throttles(task.task_id) == n and await _status_is(
                    queue, task.task_id, "pending"
                )

            await wait_until(parked, 10, f"throttle {n}")
            if n < 20:  # due now: promoted, started, parked again
                await r.zadd(keys.retry_schedule("default"), {task.task_id: 0})
        go.set()
        assert await queue.result(task.task_id, timeout=60) == 1
    done = await queue.get(task.task_id)
    assert done.attempt == 1 and done.status == TaskStatus.SUCCEEDED
    assert await throttles(task.task_id) == 20


async def test_a_limit_put_through_the_sdk_is_enforced_and_its_use_read(
    queue: Queue, settings: Settings
) -> None:
    await queue.put_limit("sdk-two", task_type="hold", concurrency=2)
    go = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        await go.wait()

    async with running_worker(fast(settings), handlers(hold=hold), concurrency=8):
        ids = [(await queue.submit("hold", {})).task_id for _ in range(5)]

        async def settled() -> bool:
            use = (await queue.get_limit("sdk-two")).use
            return use.running == 2 and use.waiting == 3

        await wait_until(settled, 10, "2 running, 3 parked for a place")
        go.set()
        ended = await queue.wait_many(ids, timeout=60)
    assert all(t.status == TaskStatus.SUCCEEDED for t in ended)
    assert (await queue.get_limit("sdk-two")).use.running == 0


async def test_an_invalid_stored_definition_is_skipped_everywhere(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """A definition written by hand that dtq cannot read stops nothing: the worker starts and
    applies the others, the list leaves it out, a put replaces it."""
    await r.hset(keys.limits("default"), "broken", "{not json")
    await define(r, "one", task_type="work", concurrency=1)
    log = Log()
    async with running_worker(fast(settings), handlers(work=log.handler(0.05)), concurrency=8):
        await all_end(queue, [(await queue.submit("work", {})).task_id for _ in range(4)])
    assert log.most == 1
    assert [limit.name for limit in await queue.list_limits()] == ["one"]
    await queue.put_limit("broken", concurrency=3)
    assert (await queue.get_limit("broken")).concurrency == 3
