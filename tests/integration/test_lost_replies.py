"""A reply lost on the wire changes nothing a user sees (DESIGN 3; docs/delivery-guarantees.md):
the worker's connection is killed right after Redis ran its scripts (``support.wire``), with
``max_attempts=1``, so an attempt counted for nothing would dead-letter the task. And the
take-over of a dead process's entries never takes one a peer claimed meanwhile."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.calls import StartReply, entry_key, start_many
from dtq.config import Settings
from dtq.connection import no_retry
from dtq.scripts import Scripts
from dtq.worker import Worker
from dtq.worker.observer import TaskFinished, WorkerObserver
from dtq_tasks import TaskContext
from support import started, wait_until
from support.wire import LosingConnection, losing_client, reset
from support.worker import backend, fast, handlers, read_as, start_as, wait_status

SHA = Scripts().sha


class Finished(WorkerObserver):
    def __init__(self) -> None:
        self.statuses: list[str] = []

    def task_finished(self, event: TaskFinished) -> None:
        self.statuses.append(event.status)


@pytest.fixture
async def wire(r: Redis) -> AsyncIterator[type[LosingConnection]]:
    reset(killer=r)
    yield LosingConnection
    reset()


def worker_on_the_wire(settings: Settings, ran: list[tuple[str, int]], **kw: Any) -> Worker:
    """A worker whose client is a :class:`LosingConnection` one; its handler ``rec`` records
    (task id, attempt) of every run."""

    async def rec(payload: Any, ctx: TaskContext) -> Any:
        ran.append((ctx.task_id, ctx.attempt))
        return payload

    client = losing_client(settings.redis_url, no_retry(), socket_timeout=10)
    return Worker(settings, handlers=handlers(rec=rec), redis=client, **kw)


async def run_once_each(r: Redis, ids: list[str], ran: list[tuple[str, int]]) -> None:
    """Each task SUCCEEDED at attempt 1, its handler ran once, nothing in the DLQ."""
    for task_id in ids:
        h = await wait_status(r, task_id, "succeeded", "dead_lettered", "failed", timeout_s=15)
        assert (h["status"], h["attempt"]) == ("succeeded", "1"), h
    assert sorted(ran) == sorted((t, 1) for t in ids)
    assert await r.xlen(keys.DEAD_LETTER) == 0


async def test_a_lost_start_reply_resumes_its_tasks_without_an_attempt(
    settings: Settings, r: Redis, queue: Queue, wire: type[LosingConnection]
) -> None:
    ids = [(await queue.submit("rec", {"i": i}, max_attempts=1)).task_id for i in range(3)]
    wire.lose_next_script_reply, wire.lose_only = (
        True,
        (SHA["start_batch"].encode(),),
    )  # its three starts, one call
    ran: list[tuple[str, int]] = []
    async with started(worker_on_the_wire(fast(settings), ran)):
        await run_once_each(r, ids, ran)
    assert not wire.lose_next_script_reply  # the start batch's reply was lost, as arranged


async def test_a_lost_finish_reply_is_told_as_what_it_recorded(
    settings: Settings, r: Redis, queue: Queue, wire: type[LosingConnection]
) -> None:
    task = await queue.submit("rec", {"i": 1}, max_attempts=1)
    wire.lose_next_script_reply, wire.lose_only = True, (SHA["finish"].encode(),)
    ran: list[tuple[str, int]] = []
    seen = Finished()
    worker = worker_on_the_wire(fast(settings), ran, observers=[seen])
    async with started(worker):
        await run_once_each(r, [task.task_id], ran)

        async def told() -> bool:
            return bool(seen.statuses)

        await wait_until(told, 10, "the finish told")
    assert not wire.lose_next_script_reply
    # Sent again, the finish found its entry acknowledged and wrote nothing; the worker tells
    # what the first one recorded.
    assert seen.statuses == ["succeeded"]
    assert worker.execution.finisher.tasks_processed == 1
    history = [json.loads(e) for e in await r.lrange(keys.history(task.task_id), 0, -1)]
    assert [e["to"] for e in history] == ["queued", "running", "succeeded"]


async def test_a_lost_read_reply_starts_its_tasks_at_once_at_attempt_1(
    settings: Settings, r: Redis, queue: Queue, wire: type[LosingConnection]
) -> None:
    """The read delivered the entries to this worker and its reply was lost: once Redis
    answers again, the worker starts what is pending for it and unknown to it, well before the
    visibility timeout would let a reaper take the entries."""
    ids = [(await queue.submit("rec", {"i": i}, max_attempts=1)).task_id for i in range(3)]
    wire.lose_next_script_reply, wire.lose_only = True, (SHA["read"].encode(),)
    ran: list[tuple[str, int]] = []
    async with started(worker_on_the_wire(fast(settings, visibility_timeout_s=60), ran)):
        await run_once_each(r, ids, ran)
    assert not wire.lose_next_script_reply


async def test_adopt_never_takes_an_entry_a_peer_claimed_meanwhile(
    settings: Settings, r: Redis, queue: Queue, wire: type[LosingConnection]
) -> None:
    """A dead process's entry, idle past the visibility timeout: right after the worker that
    replaces the process first hears back from Redis about the dead consumer, a peer's reaper
    claims the entry and starts it. The entry stays the peer's, and runs nowhere else."""
    s = fast(settings, visibility_timeout_s=30)
    task = await queue.submit("rec", {"i": 1}, max_attempts=3)
    entry = await read_as(r, "worker-dead0001")
    await r.xclaim(
        entry.stream,
        keys.CONSUMER_GROUP,
        "worker-dead0001",
        0,
        [entry.entry_id],
        idle=60_000,
        justid=True,
    )
    peer: list[str] = []

    async def peer_reaper() -> None:
        _, claimed, *_ = await r.xautoclaim(
            entry.stream, keys.CONSUMER_GROUP, "worker-peer0002", 30_000, "0-0"
        )
        for entry_id, _fields in claimed:
            peer.append(entry_id)
            assert (await start_as(r, entry, "worker-peer0002", s)).kind == "run"

    wire.hook, wire.hook_on = peer_reaper, b"worker-dead0001"
    ran: list[tuple[str, int]] = []
    worker = worker_on_the_wire(s, ran, adopt=["worker-dead0001"], worker_id="worker-new00003")
    async with started(worker):
        assert peer == [entry.entry_id]  # the peer's reaper took it, as arranged
        [row] = await r.xpending_range(entry.stream, keys.CONSUMER_GROUP, "-", "+", 10)
        assert row["consumer"] == "worker-peer0002"
        h = await r.hgetall(keys.task(task.task_id))
        assert (h["status"], h["attempt"], h["worker_id"]) == ("running", "1", "worker-peer0002")
        assert entry_key(entry.stream, entry.entry_id) not in worker.inflight
    assert ran == []


async def test_a_resume_counts_the_attempt_unless_its_own_start_ran(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """start.lua's resume runs a task at the attempt already set only when the hash carries
    the token of the start being resumed; a resume of a start that never ran, on a task this
    worker ran before under that entry, is a crash redelivery like any start."""
    task = await queue.submit("rec", {}, max_attempts=3)
    entry = await read_as(r, "worker-a0000001")
    db = backend(r, settings)
    [first] = await start_many(db, [entry], "worker-a0000001", "t1")
    assert isinstance(first, StartReply) and first.attempt == 1
    before = await r.llen(keys.history(task.task_id))
    resume = entry_key(entry.stream, entry.entry_id)
    [again] = await start_many(db, [entry], "worker-a0000001", "t2", {resume: "t1"})
    assert isinstance(again, StartReply) and (again.kind, again.attempt) == ("run", 1)
    assert await r.llen(keys.history(task.task_id)) == before  # nothing written
    [other] = await start_many(db, [entry], "worker-a0000001", "t3", {resume: "t9"})
    assert isinstance(other, StartReply) and (other.kind, other.attempt) == ("run", 2)
    # the call resumed is the lost start, sent again: its token is the one kept now
    assert await r.hget(keys.task(task.task_id), "start_token") == "t9"


async def test_a_lost_adopt_reply_starts_the_claimed_entries_at_once(
    settings: Settings, r: Redis, queue: Queue, wire: type[LosingConnection]
) -> None:
    """adopt.lua claimed a dead process's entry for the worker and its reply was lost: the
    entry is started once Redis answers, not after the visibility timeout."""
    task = await queue.submit("rec", {}, max_attempts=1)
    entry = await read_as(r, "worker-dead0001")
    wire.lose_next_script_reply = True
    wire.lose_only = (SHA["adopt"].encode(), entry.stream.encode())  # the call that claims it
    ran: list[tuple[str, int]] = []
    s = fast(settings, visibility_timeout_s=60)
    async with started(worker_on_the_wire(s, ran, adopt=["worker-dead0001"])):
        await run_once_each(r, [task.task_id], ran)
    assert not wire.lose_next_script_reply
