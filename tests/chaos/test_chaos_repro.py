"""Minimal reproductions of what the chaos scenarios found, kept as regression tests.

1. A zombie's start script (a worker that read an entry, stalled, and resumed after another
   worker had reclaimed the entry and started it) took the task over: start.lua saw "running
   with this entry" and treated it as a crash redelivery, so the zombie ran attempt n + 1 while
   the legitimate worker's finish was fenced; with attempts exhausted the zombie dead-lettered
   a task that was running fine. start.lua now checks, like finish.lua, that the entry is
   pending for the caller, and does nothing otherwise.
2. A worker stopped between its start script and its handler (SIGSTOP, a VM pause) started the
   handler after resuming, although another worker had meanwhile finished the task: an
   execution after the terminal state. The worker now checks its lease before a handler starts
   when the start is older than half the visibility timeout.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from chaos_checker import read_execs
from chaos_harness import VISIBILITY_S, Cluster, EventLog, now_ns, wait_until
from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.calls import Entry, Outcome, StartReply, finish_call, finish_many, start_many
from dtq.config import Settings
from dtq.scripts import Scripts
from dtq.store import Store

STREAM = keys.stream("default", 5)


async def _deliver(r: Redis, consumer: str) -> Entry:
    reply = await r.xreadgroup(keys.CONSUMER_GROUP, consumer, {STREAM: ">"}, count=1)
    (_, [(entry_id, fields)]) = reply[0]
    entry = Entry.parse(STREAM, entry_id, fields)
    assert entry is not None
    return entry


async def _reclaim(r: Redis, consumer: str) -> None:
    """What a reaper does once the entry's idle time passed the visibility timeout."""
    await r.xautoclaim(STREAM, keys.CONSUMER_GROUP, consumer, 0, "0-0")


def _backend(r: Redis, settings: Settings) -> Store:
    return Store(r, Scripts(), settings)


async def _start(r: Redis, entry: Entry, consumer: str, settings: Settings) -> StartReply:
    [reply] = await start_many(_backend(r, settings), [entry], consumer)
    assert not isinstance(reply, Exception), reply
    return reply


@pytest.mark.parametrize("max_attempts", [3, 1])
async def test_a_zombie_start_does_not_take_over_a_reclaimed_entry(
    settings: Settings, r: Redis, queue: Queue, max_attempts: int
) -> None:
    task = await queue.submit("chaos_work", {"seq": 1}, max_attempts=max_attempts)
    entry = await _deliver(r, "zombie")  # read, then the zombie stalls before start.lua
    await _reclaim(r, "worker-b")
    assert (await _start(r, entry, "worker-b", settings)).kind == "run"
    history = await r.lrange(keys.history(task.task_id), 0, -1)

    late = await _start(r, entry, "zombie", settings)  # the zombie resumes

    assert (late.kind, late.detail) == ("fenced", "owner:worker-b")
    h = await r.hgetall(keys.task(task.task_id))
    assert (h["status"], h["attempt"], h["worker_id"]) == ("running", "1", "worker-b")
    assert await r.lrange(keys.history(task.task_id), 0, -1) == history
    [pending] = await r.xpending_range(STREAM, keys.CONSUMER_GROUP, "-", "+", 10)
    assert pending["consumer"] == "worker-b"
    done = Outcome("success", duration_ms=1, result_json="{}")
    call = finish_call(entry, 1, done, "worker-b", settings)
    [reply] = await finish_many(_backend(r, settings), [call])
    assert not isinstance(reply, Exception) and reply.status == "succeeded", reply
    assert not await r.xlen(STREAM)


async def test_a_start_for_an_entry_nobody_holds_does_nothing(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit("chaos_work", {"seq": 1})
    entry = await _deliver(r, "worker-a")
    await r.xack(STREAM, keys.CONSUMER_GROUP, entry.entry_id)  # e.g. a peer finished it
    reply = await _start(r, entry, "worker-a", settings)
    assert (reply.kind, reply.detail) == ("fenced", "not_pending")
    assert (await r.hgetall(keys.task(task.task_id)))["status"] == "queued"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        c.start_redis()
        yield c
    finally:
        c.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
async def test_a_worker_stopped_before_its_handler_does_not_run_it_after_resuming(
    cluster: Cluster,
) -> None:
    r = cluster.redis_client()
    queue = await connect(settings=Settings(redis_url=cluster.url))
    try:
        with EventLog(cluster.url) as events:
            zombie = cluster.spawn_worker("z", env={"CHAOS_CRASH": "1"}, entry="chaos")
            await cluster.wait_workers([zombie])
            # The zombie SIGSTOPs itself after start.lua made the task RUNNING, before the
            # handler: the window a pause of the whole process can hit.
            task = await queue.submit("chaos_work", {"seq": 1, "crash": "stop_before_handler"})

            async def stopped() -> bool:
                return _stopped(zombie.pid)

            await wait_until(stopped, 20, "zombie stopped itself")
            t_stop = now_ns()
            peer = cluster.spawn_worker("peer")

            async def done() -> bool:
                return await r.hget(keys.task(task.task_id), "status") == "succeeded"

            await wait_until(done, 30, "the peer finished the task")
            zombie.proc.signal(signal.SIGCONT)

            async def noticed() -> bool:
                return "lease lost" in zombie.proc.output()

            await wait_until(noticed, 10, "the zombie noticed its lease was gone")
            await asyncio.sleep(VISIBILITY_S)
        h = await r.hgetall(keys.task(task.task_id))
        runs = read_execs(cluster.exec_dir)[task.task_id]
        assert [(e.attempt, e.worker_id) for e in runs] == [(2, peer.worker_id)]
        assert (h["status"], h["attempt"], h["worker_id"]) == ("succeeded", "2", peer.worker_id)
        history = [x for x in await queue.history(task.task_id) if x.worker_id == zombie.worker_id]
        assert all(x.ts.timestamp() * 1e9 < t_stop for x in history)
        terminal = [e for e in events.events() if e["type"] == "TASK_SUCCEEDED"]
        assert len(terminal) == 1
    finally:
        await queue.close()
        await r.aclose()
