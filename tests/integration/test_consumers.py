"""Consumers of the ``workers`` group stay bounded (docs/redis-schema.md): deleted only when they
hold no pending entry (one atomic script), by a worker at graceful stop for itself and by the
scheduler leader for workers that are not alive; never one that holds an entry."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import Queue, keys
from dtq.calls import drop_consumers
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.worker.consumers import drop_dead
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.worker import WorkerProcess, fast, handlers, read_as, wait_status, wait_worker_ready

P5 = keys.stream("default", 5)


async def consumers(r: Redis, stream: str = P5) -> dict[str, int]:
    """name -> pending entries of each consumer of the stream's group ({} without a group)."""
    try:
        rows = await r.xinfo_consumers(stream, keys.CONSUMER_GROUP)
    except ResponseError:
        return {}
    return {str(c["name"]): int(c["pending"]) for c in rows}


async def everywhere(r: Redis, queue: str = "default") -> dict[str, dict[str, int]]:
    """stream -> its consumers, for the streams of ``queue`` that have any."""
    out = {}
    for stream in keys.queue_streams(queue):
        found = await consumers(r, stream)
        if found:
            out[stream] = found
    return out


async def named(r: Redis, name: str, queue: str = "default") -> dict[str, int]:
    """stream -> pending entries of consumer ``name``, where it exists."""
    return {s: c[name] for s, c in (await everywhere(r, queue)).items() if name in c}


async def noop(payload: dict[str, Any], ctx: TaskContext) -> None:
    return None


async def assert_not_lost(r: Redis, task_ids: list[str], stream: str = P5) -> None:
    """A RUNNING task's entry is pending for some consumer (read before the hashes: a task
    still RUNNING now was RUNNING then, and its entry had to be pending)."""
    rows = await r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 1000)
    pending = {str(p["message_id"]) for p in rows}
    for tid in task_ids:
        status, entry_id = await r.hmget(keys.task(tid), "status", "entry_id")
        if status == "running":
            assert entry_id in pending, f"task {tid} is RUNNING, its entry pending for nobody"


# -- the script -------------------------------------------------------------------------------


async def test_a_consumer_holding_an_entry_is_never_deleted(r: Redis, queue: Queue) -> None:
    await queue.submit("echo_task", {})
    held = await read_as(r, "worker-held0001")
    await queue.submit("echo_task", {})
    done = await read_as(r, "worker-idle0002")
    await r.xack(P5, keys.CONSUMER_GROUP, done.entry_id)
    names = ["worker-held0001", "worker-idle0002", "worker-never003"]

    assert await drop_consumers(queue.store, [(P5, names)], min_idle_ms=60_000) == [[]]
    assert await drop_consumers(queue.store, [(P5, names)]) == [["worker-idle0002"]]
    assert await consumers(r) == {"worker-held0001": 1}
    pending = await r.xpending_range(P5, keys.CONSUMER_GROUP, "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [
        (held.entry_id, "worker-held0001")
    ]
    assert await drop_consumers(queue.store, [(keys.stream("nowhere", 5), names)]) == [[]]


async def test_the_leader_pass_spares_live_workers_and_held_entries(r: Redis, queue: Queue) -> None:
    await queue.submit("echo_task", {})
    await read_as(r, "worker-deadheld")  # dead (no hash), holds an entry
    for name in ("worker-deadidle", "worker-liveidle"):
        await queue.submit("echo_task", {})
        e = await read_as(r, name)
        await r.xack(P5, keys.CONSUMER_GROUP, e.entry_id)
    now_ms = await redis_time_ms(r)
    await r.hset(keys.worker("worker-liveidle"), mapping={"last_heartbeat_ms": now_ms})
    await r.sadd(keys.WORKERS, "worker-liveidle")

    dropped = await drop_dead(queue.store, now_ms, stale_ms=15_000, min_idle_ms=0)
    assert dropped == [(P5, "worker-deadidle")]
    assert await consumers(r) == {"worker-deadheld": 1, "worker-liveidle": 0}
    # A heartbeat older than three intervals is not alive any more.
    later_ms = now_ms + 15_001
    assert await drop_dead(queue.store, later_ms, 15_000, 0) == [(P5, "worker-liveidle")]
    assert await consumers(r) == {"worker-deadheld": 1}


# -- workers ------------------------------------------------------------------------------------


async def test_a_stopped_worker_leaves_no_consumer(
    r: Redis, queue: Queue, settings: Settings
) -> None:
    s = fast(settings)
    for i in range(5):  # workers restarted with a new id each time
        wid = f"worker-restart{i}"
        async with running_worker(s, handlers(rs_noop=noop), worker_id=wid):
            task = await queue.submit("rs_noop", {})
            await wait_status(r, task.task_id, "succeeded")
            assert wid in await consumers(r)
        assert await named(r, wid) == {}
    assert await everywhere(r) == {}


async def test_a_live_worker_whose_idle_consumer_was_deleted_reads_on(
    r: Redis, queue: Queue, settings: Settings
) -> None:
    wid = "worker-recreate"
    async with running_worker(fast(settings), handlers(rs_noop=noop), worker_id=wid):
        first = await queue.submit("rs_noop", {})
        await wait_status(r, first.task_id, "succeeded")
        assert await drop_consumers(queue.store, [(P5, [wid])]) == [[wid]]
        assert wid not in await consumers(r)
        second = await queue.submit("rs_noop", {})
        await wait_status(r, second.task_id, "succeeded")
        assert wid in await consumers(r)


async def test_an_entry_left_by_the_drain_keeps_its_consumer_until_a_peer_has_it(
    r: Redis, queue: Queue, settings: Settings
) -> None:
    """Drain timeout: the entry stays pending for the stopped worker, so does its consumer; a
    peer reclaims and runs the task, then the peer (the leader) deletes the consumer."""
    s = fast(settings, drain_timeout_s=0.2)
    ran: list[str] = []

    async def slow_once(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(ctx.worker_id)
        if ctx.attempt == 1:
            await asyncio.sleep(30)

    hs = handlers(rs_slow=slow_once)
    async with running_worker(s, hs, worker_id="worker-drained1"):
        task = await queue.submit("rs_slow", {})
        await wait_status(r, task.task_id, "running")
    assert await named(r, "worker-drained1") == {P5: 1}
    async with running_worker(s, hs, worker_id="worker-peer0001"):

        async def consumer_gone() -> bool:
            await assert_not_lost(r, [task.task_id])
            return not await named(r, "worker-drained1")

        await wait_until(consumer_gone, 15, "the drained worker's consumer deleted")
        await wait_status(r, task.task_id, "succeeded")
    assert ran == ["worker-drained1", "worker-peer0001"]


# -- killed worker processes ------------------------------------------------------------------


async def holder(r: Redis, stream: str) -> str | None:
    rows = await r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 1)
    return str(rows[0]["consumer"]) if rows else None


@pytest.mark.slow
async def test_killed_workers_consumers_go_once_their_entries_are_reclaimed(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue
) -> None:
    """Two workers SIGKILLed while each runs a task: their consumers stay while they hold the
    entries, a peer reclaims and runs both, then its leader pass deletes the dead consumers; what
    is left is the peer's consumers."""
    dead = ["worker-kill0001", "worker-kill0002"]
    tasks = []
    for wid in dead:
        proc = spawn(wid)
        await wait_worker_ready(r, wid)
        task = await queue.submit("sp_sleep", {"by_attempt": [60, 0]})
        await wait_status(r, task.task_id, "running")
        assert await r.hget(keys.task(task.task_id), "worker_id") == wid
        proc.signal(signal.SIGKILL)
        proc.wait(10)
        tasks.append(task)
    assert {name for name, n in (await consumers(r)).items() if n} == set(dead)
    spawn("worker-peer0002")

    async def all_gone() -> bool:
        await assert_not_lost(r, [t.task_id for t in tasks])
        found = await everywhere(r)
        return all(wid not in c for c in found.values() for wid in dead)

    await wait_until(all_gone, 30, "the killed workers' consumers deleted")
    for task in tasks:
        h = await wait_status(r, task.task_id, "succeeded", timeout_s=10)
        assert h["worker_id"] == "worker-peer0002"
    assert {n for c in (await everywhere(r)).values() for n in c} == {"worker-peer0002"}


@pytest.mark.slow
async def test_an_entry_nobody_can_claim_keeps_its_dead_consumer(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue
) -> None:
    """The killed worker served queue q2 alone: no peer claims its entry, so its consumer on
    that stream stays for as long as it holds it, while its idle consumers go."""
    a = spawn("worker-lonely01", "--queue", "q2")
    await wait_worker_ready(r, "worker-lonely01")
    quick = await queue.submit("sp_sleep", {"s": 0}, queue="q2", priority=9)
    await wait_status(r, quick.task_id, "succeeded")
    task = await queue.submit("sp_sleep", {"s": 60}, queue="q2")
    await wait_status(r, task.task_id, "running")
    assert await named(r, "worker-lonely01", "q2") == {
        keys.stream("q2", 9): 0,
        keys.stream("q2", 5): 1,
    }
    a.signal(signal.SIGKILL)
    a.wait(10)
    spawn("worker-leader01")  # serves default only: it never claims the q2 entry

    async def idle_ones_gone() -> bool:
        return list(await named(r, "worker-lonely01", "q2")) == [keys.stream("q2", 5)]

    await wait_until(idle_ones_gone, 20, "the dead worker's idle consumers deleted")
    assert await named(r, "worker-lonely01", "q2") == {keys.stream("q2", 5): 1}
    assert await holder(r, keys.stream("q2", 5)) == "worker-lonely01"
    assert await r.hget(keys.task(task.task_id), "status") == "running"
