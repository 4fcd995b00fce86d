"""Real signals on real worker processes (``python -m dtq.worker``): SIGKILL, SIGSTOP/SIGCONT,
a handler that kills its own process under ``--processes``, and SIGTERM drains. Every process
is stopped by PID at the end, whatever happens."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from support import Events, wait_until
from support.worker import WorkerProcess, calls, wait_status, wait_worker_ready

pytestmark = pytest.mark.slow


async def started_by(r: Redis, task_id: str, attempt: int, worker_id: str) -> bool:
    return f"start:{attempt}:{worker_id}" in await calls(r, task_id)


@pytest.mark.backends("single", "cluster")
async def test_sigkilled_worker_task_is_finished_by_another(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue
) -> None:
    a = spawn("worker-aaaa0001")
    await wait_worker_ready(r, "worker-aaaa0001")
    task = await queue.submit("sp_sleep", {"by_attempt": [30, 0.1]}, max_attempts=3)
    await wait_until(lambda: started_by(r, task.task_id, 1, "worker-aaaa0001"), 10, "A runs it")
    a.signal(signal.SIGKILL)
    a.wait(5)
    spawn("worker-bbbb0002")
    h = await wait_status(r, task.task_id, "succeeded", timeout_s=20)
    assert h["attempt"] == "2" and h["worker_id"] == "worker-bbbb0002"
    assert await calls(r, task.task_id) == [
        "start:1:worker-aaaa0001",
        "start:2:worker-bbbb0002",
        "end:2:worker-bbbb0002",
    ]
    assert await r.xlen(keys.stream("default", 5)) == 0


async def test_sigstopped_zombie_writes_nothing_and_acks_nothing(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue
) -> None:
    a = spawn("worker-aaaa0001")
    await wait_worker_ready(r, "worker-aaaa0001")
    task = await queue.submit("sp_sleep", {"by_attempt": [1.0, 4.0]}, max_attempts=3)
    await wait_until(lambda: started_by(r, task.task_id, 1, "worker-aaaa0001"), 10, "A runs it")
    a.signal(signal.SIGSTOP)
    spawn("worker-bbbb0002")
    await wait_until(lambda: started_by(r, task.task_id, 2, "worker-bbbb0002"), 20, "B took it")
    stream = keys.stream("default", 5)
    before = await r.hgetall(keys.task(task.task_id))
    history_before = await r.lrange(keys.history(task.task_id), 0, -1)
    a.signal(signal.SIGCONT)  # A's handler timer has long passed: it wants to finish now

    async def zombie_noticed() -> bool:
        out = a.output()
        return "fenced" in out or "lease lost" in out or "taken over" in out

    await wait_until(zombie_noticed, 10, "A notices it lost the entry")
    # B is still running attempt 2 (4 s): A wrote nothing and acknowledged nothing.
    h = await r.hgetall(keys.task(task.task_id))
    assert h["status"] == "running" and h["attempt"] == "2"
    assert h == before
    assert await r.lrange(keys.history(task.task_id), 0, -1) == history_before
    [pending] = await r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 10)
    assert pending["consumer"] == "worker-bbbb0002"
    assert not await r.exists(keys.result(task.task_id))
    done = await wait_status(r, task.task_id, "succeeded", timeout_s=15)
    assert done["worker_id"] == "worker-bbbb0002" and done["attempt"] == "2"
    statuses = [x.to_status for x in await queue.history(task.task_id)]
    assert statuses.count("succeeded") == 1
    assert (await queue.get(task.task_id)).result == {
        "attempt": 2,
        "worker_id": "worker-bbbb0002",
    }


async def test_handler_killing_its_process_ends_worker_lost_without_loop(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue
) -> None:
    sup = spawn(None, "--processes", "2", "--concurrency", "2")

    async def two_ready() -> bool:
        ids = await r.smembers(keys.WORKERS)
        if len(ids) < 2:
            return False
        st = [await r.hget(keys.worker(i), "status") for i in ids]
        return sum(s in {"ready", "busy"} for s in st) >= 2

    await wait_until(two_ready, 20, "two supervised workers")
    task = await queue.submit("sp_crash", {}, max_attempts=3)
    h = await wait_status(r, task.task_id, "dead_lettered", timeout_s=40)
    assert h["error_class"] == "WorkerLost"
    started = await calls(r, task.task_id)
    assert [c.split(":")[1] for c in started] == ["1", "2", "3"]
    assert len({c.split(":")[2] for c in started}) >= 2  # restarted / other processes
    stream = keys.stream("default", 5)
    assert await r.xlen(stream) == 0  # nothing left to redeliver: no loop
    assert (await r.xpending(stream, keys.CONSUMER_GROUP))["pending"] == 0
    [(_, fields)] = await r.xrange(keys.DEAD_LETTER)
    assert fields["last_error_class"] == "WorkerLost" and fields["attempts_made"] == "3"
    assert sup.process.poll() is None  # the supervisor lives on
    pids = [int(p) for p in [await r.hget(k, "pid") for k in await r.keys("dtq:worker:*")] if p]
    sup.signal(signal.SIGTERM)
    assert sup.wait(20) == 0
    for pid in pids:  # every child is gone with the supervisor (it waited for each)
        assert not _alive(pid), pid


async def test_a_dead_childs_entries_go_to_its_replacement_at_once(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue
) -> None:
    """--processes: the child that replaces one that died takes over its entries as it
    starts. The visibility timeout is 300 s here, so the reaper is not what recovers them."""
    sup = spawn(None, "--processes", "2", "--concurrency", "2", VISIBILITY_TIMEOUT_S=300)

    async def ready_ids() -> set[str]:
        ids = await r.smembers(keys.WORKERS)
        return {i for i in ids if await r.hget(keys.worker(i), "status") in {"ready", "busy"}}

    await wait_until(lambda: _at_least(ready_ids, 2), 20, "two supervised workers")
    task = await queue.submit("sp_sleep", {"by_attempt": [60, 0.1]}, max_attempts=3)
    await wait_until(lambda: _has_call(r, task.task_id, "start:1:"), 10, "attempt 1 runs")
    [first] = [c.split(":")[2] for c in await calls(r, task.task_id)]
    victim = int(await r.hget(keys.worker(first), "pid") or 0)
    os.kill(victim, signal.SIGKILL)
    h = await wait_status(r, task.task_id, "succeeded", timeout_s=30)
    assert h["attempt"] == "2" and h["worker_id"] != first
    reasons = [x.reason for x in await queue.history(task.task_id) if x.to_status == "running"]
    assert reasons == ["started", "redelivered"]
    assert f"taking over 1 entry of {first}" in sup.output()
    assert sup.process.poll() is None  # the supervisor lives on, with two children again
    await wait_until(lambda: _at_least(ready_ids, 2), 20, "the slot filled again")


async def _at_least(found: Callable[[], Any], n: int) -> bool:
    return len(await found()) >= n


async def _has_call(r: Redis, task_id: str, prefix: str) -> bool:
    return any(c.startswith(prefix) for c in await calls(r, task_id))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def test_sigterm_drains_in_flight_work(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue, redis_url: str
) -> None:
    async with Events(r) as events:
        a = spawn("worker-aaaa0001", "--concurrency", "4", DRAIN_TIMEOUT_S=10)
        await wait_worker_ready(r, "worker-aaaa0001")
        tasks = [await queue.submit("sp_sleep", {"s": 1.0}) for _ in range(3)]
        tasks.append(await queue.submit("sp_block", {"s": 1.0}))
        for t in tasks:
            await wait_until(
                lambda t=t: started_by(r, t.task_id, 1, "worker-aaaa0001"), 10, "all started"
            )
        a.signal(signal.SIGTERM)
        assert a.wait(15) == 0
        await wait_until(lambda: _has(events, "WORKER_STOPPED"), 5, "WORKER_STOPPED")
    for t in tasks:
        h = await r.hgetall(keys.task(t.task_id))
        assert h["status"] == "succeeded" and h["attempt"] == "1", h
    assert await r.hget(keys.worker("worker-aaaa0001"), "status") == "stopped"
    assert not await r.sismember(keys.WORKERS, "worker-aaaa0001")
    assert [e.worker_id for e in events.of("WORKER_STARTED")] == ["worker-aaaa0001"]
    assert [e.worker_id for e in events.of("WORKER_STOPPED")] == ["worker-aaaa0001"]


async def _has(events: Events, etype: str) -> bool:
    return bool(events.of(etype))


async def test_sigterm_past_drain_timeout_leaves_work_for_another_worker(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue
) -> None:
    a = spawn("worker-aaaa0001", "--concurrency", "4", DRAIN_TIMEOUT_S=0.3)
    await wait_worker_ready(r, "worker-aaaa0001")
    tasks = [
        await queue.submit("sp_sleep", {"by_attempt": [30, 0.1]}),
        await queue.submit("sp_block", {"by_attempt": [30, 0.1]}),
    ]
    for t in tasks:
        await wait_until(lambda t=t: started_by(r, t.task_id, 1, "worker-aaaa0001"), 10, "run")
    a.signal(signal.SIGTERM)
    assert a.wait(15) == 0  # a blocked handler thread does not hold the process
    stream = keys.stream("default", 5)
    for t in tasks:  # not acknowledged: still running, still pending
        assert (await r.hgetall(keys.task(t.task_id)))["status"] == "running"
    assert (await r.xpending(stream, keys.CONSUMER_GROUP))["pending"] == 2
    spawn("worker-bbbb0002")
    for t in tasks:
        h = await wait_status(r, t.task_id, "succeeded", timeout_s=20)
        assert h["attempt"] == "2" and h["worker_id"] == "worker-bbbb0002"
    assert await r.xlen(stream) == 0
