"""The poll loop (contract section 6): strict priority p9 -> p0 across queues, prefetch bounded
by free capacity, paused queues skipped, an idle worker woken by a new entry of any priority,
and start scripts batched per read."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq.worker import Worker
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.worker import fast, handlers, wait_status


async def test_concurrency_one_runs_every_p9_before_any_p0(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    order: list[int] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        order.append(payload["p"])

    await queue.submit_many([{"task_type": "wt_rec", "payload": {"p": 0}, "priority": 0}] * 100)
    await queue.submit_many([{"task_type": "wt_rec", "payload": {"p": 9}, "priority": 9}] * 10)
    async with running_worker(fast(settings), handlers(wt_rec=record), concurrency=1):
        await wait_until(_len_is(order, 110), 30, "110 tasks run")
    assert order[:10] == [9] * 10
    assert order[10:] == [0] * 100


def _len_is(items: list[Any], n: int) -> Any:
    async def check() -> bool:
        return len(items) >= n

    return check


async def test_priority_is_strict_across_queues(settings: Settings, r: Redis, queue: Queue) -> None:
    order: list[str] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        order.append(f"{ctx.queue}:{payload['p']}")

    for q, p in (("alpha", 1), ("beta", 8), ("alpha", 8), ("beta", 1), ("alpha", 5)):
        await queue.submit("wt_rec", {"p": p}, queue=q, priority=p)
    async with running_worker(
        fast(settings), handlers(wt_rec=record), queues=("alpha", "beta"), concurrency=1
    ):
        await wait_until(_len_is(order, 5), 10, "5 tasks run")
    assert [o.split(":")[1] for o in order] == ["8", "8", "5", "1", "1"]


async def test_entries_of_two_streams_with_one_id_both_run(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """Streams number their entries apart: one submit call adding to two queues in the same
    millisecond gives both entries the same id. A worker holding both must run both (it once
    took the second for the first, already in flight, and left it to the reaper)."""
    ran: list[str] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(ctx.queue)
        await asyncio.sleep(0.2)  # both in flight at once

    for _ in range(50):  # the two XADDs of one script fall in one millisecond nearly always
        tasks = await queue.submit_many(
            [{"task_type": "wt_same", "payload": {}, "queue": q} for q in ("alpha", "beta")]
        )
        ids = [await r.hget(keys.task(t.task_id), "entry_id") for t in tasks]  # type: ignore[union-attr]
        if ids[0] == ids[1]:
            break
        for q in ("alpha", "beta"):
            await queue.purge_queue(q)
    assert ids[0] == ids[1]
    slow = fast(settings, visibility_timeout_s=60, heartbeat_interval_s=5)
    async with running_worker(slow, handlers(wt_same=record), queues=("alpha", "beta")):
        await wait_until(_len_is(ran, 2), 5, "both tasks run (not left to the reaper)")
    assert sorted(ran) == ["alpha", "beta"]


async def test_prefetch_never_exceeds_free_capacity(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    release = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        await release.wait()

    await queue.submit_many([{"task_type": "wt_hold", "payload": {}}] * 20)
    stream = keys.stream("default", 5)
    samples: list[int] = []
    async with running_worker(fast(settings), handlers(wt_hold=hold), concurrency=3):

        async def three_running() -> bool:
            info = await r.xpending(stream, keys.CONSUMER_GROUP)
            samples.append(int(info["pending"]))
            return samples[-1] == 3

        await wait_until(three_running, 5, "3 delivered")
        for _ in range(20):  # it stays at the capacity while all slots are busy
            info = await r.xpending(stream, keys.CONSUMER_GROUP)
            samples.append(int(info["pending"]))
            await asyncio.sleep(0.01)
        release.set()
        await wait_until(lambda: _stream_empty(r, stream), 10, "all done")
    assert max(samples) == 3


async def _stream_empty(r: Redis, stream: str) -> bool:
    return await r.xlen(stream) == 0


async def test_every_slot_comes_back(settings: Settings, r: Redis, queue: Queue) -> None:
    """Slots are reserved per read (up to the free capacity) and come back from the part a
    read did not fill, from entries a start did not run and from ended executions: once the
    worker has stopped, none is taken."""

    async def ok(payload: dict[str, Any], ctx: TaskContext) -> None:
        if payload["i"] % 5 == 0:
            raise ValueError("a failure, not retried")

    await queue.submit_many(
        [{"task_type": "wt_ok", "payload": {"i": i}, "max_attempts": 1} for i in range(30)]
    )
    stream = keys.stream("default", 5)
    for n in range(3):  # entries of tasks that do not exist: their start consumes them unrun
        await r.xadd(stream, {"task_id": f"{n:032x}", "task_type": "wt_ok", "payload": "{}"})
    async with running_worker(fast(settings), handlers(wt_ok=ok), concurrency=8) as worker:
        await wait_until(lambda: _stream_empty(r, stream), 10, "all done")
    assert worker.active_tasks == 0


@pytest.mark.parametrize("concurrency", [4, 32])
async def test_idle_worker_starts_new_task_of_any_priority_within_block(
    settings: Settings, r: Redis, queue: Queue, concurrency: int
) -> None:
    """An idle worker watches every stream: with fewer free slots than streams (4 < 20) by
    XREAD, with at least as many (32) by XREADGROUP BLOCK, which delivers the entry itself."""

    async def noop(payload: dict[str, Any], ctx: TaskContext) -> None:
        return None

    async with running_worker(
        fast(settings), handlers(wt_noop=noop), queues=("q1", "q2"), concurrency=concurrency
    ):
        for q, p in (("q2", 0), ("q1", 9), ("q2", 4)):
            t0 = time.monotonic()
            task = await queue.submit("wt_noop", {}, queue=q, priority=p)
            await wait_status(r, task.task_id, "succeeded", timeout_s=2)
            assert time.monotonic() - t0 < 0.5, (q, p)


async def test_paused_queue_is_skipped_and_resumed(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    async def noop(payload: dict[str, Any], ctx: TaskContext) -> None:
        return None

    async with running_worker(fast(settings), handlers(wt_noop=noop), queues=("paused", "open")):
        paused_at = await queue.now()
        await r.set(keys.queue_paused("paused"), "1")

        async def one_second_later() -> bool:  # paused queues are skipped within a second
            return (await queue.now() - paused_at).total_seconds() >= 1.0

        await wait_until(one_second_later, 3, "a second passed")
        held = await queue.submit("wt_noop", {}, queue="paused", priority=9)
        served = await queue.submit("wt_noop", {}, queue="open", priority=0)
        await wait_status(r, served.task_id, "succeeded", timeout_s=2)
        assert (await queue.get(held.task_id)).status == "queued"
        await r.delete(keys.queue_paused("paused"))
        await wait_status(r, held.task_id, "succeeded", timeout_s=2)


async def test_blocking_read_stays_within_the_slots_it_holds(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """Entries that land on several streams between a read that found none and the
    XREADGROUP BLOCK after it are answered at once, from every stream: COUNT slots // streams
    keeps the delivery within the slots the loop holds."""
    for p in range(10):
        await queue.submit_many([{"task_type": "wt_noop", "payload": {}, "priority": p}] * 3)
    streams = keys.queue_streams("default")
    worker = Worker(fast(settings), handlers=handlers(), concurrency=25)
    try:
        got = await worker.intake._read_blocking(dict.fromkeys(streams, "0-0"), 25)
    finally:
        await worker.redis.aclose()
    assert len(got.entries) == 20  # 2 per stream, 25 // 10
    pending = [(await r.xpending(s, keys.CONSUMER_GROUP))["pending"] for s in streams]
    assert pending == [2] * 10


async def test_vanished_stream_and_group_are_created_again(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """A stream deleted under a running worker (its consumer group with it): the next read
    gets NOGROUP from that stream, the worker creates the group again and goes on."""

    async def noop(payload: dict[str, Any], ctx: TaskContext) -> None:
        return None

    async with running_worker(fast(settings), handlers(wt_noop=noop)):
        p9 = keys.stream("default", 9)
        await r.delete(p9)

        async def group_back() -> bool:
            if not await r.exists(p9):
                return False
            groups = await r.xinfo_groups(p9)
            return any(g["name"] == keys.CONSUMER_GROUP for g in groups)

        await wait_until(group_back, 5, "group on p9 again")
        task = await queue.submit("wt_noop", {}, priority=9)
        await wait_status(r, task.task_id, "succeeded")
