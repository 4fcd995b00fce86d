"""Entries removed outside dtq (``XDEL``, ``XTRIM``, a stream deleted by hand) and the paused
queues' pending entries (docs/delivery-guarantees.md, "Entries removed outside dtq").

Every task still reaches exactly one terminal state, on Redis 6.2 as on Redis 7 and Valkey 8
(which drop a deleted entry from the pending list at its next ``XCLAIM``):

- a QUEUED task whose entry is gone gets a new one from the scheduler leader's pass over the
  task hashes, and runs;
- a RUNNING task whose entry is removed under a live worker runs on, is not cancelled, and its
  finish is recorded once on its hash (an entry pending for another consumer stays fenced);
- a RUNNING task whose worker died and whose entry is gone is a crash redelivery: attempt + 1,
  or WorkerLost in the dead-letter queue past max_attempts;
- a dead worker's running entry on a paused queue is redelivered, and a cancel of it honoured.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.calls import Outcome, entry_key, touch
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.errors import TaskRunningError
from dtq.worker import lost_entries, scheduler
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.worker import fast, finish_as, handlers, read_as, start_as, wait_status

DEAD = "worker-deaddead"
SUCCESS = Outcome("success")
STREAM = keys.stream("default", 5)

Remove = Callable[[Redis, str, str], Awaitable[Any]]


async def _xdel(r: Redis, stream: str, entry_id: str) -> None:
    assert await r.xdel(stream, entry_id) == 1


async def _xtrim(r: Redis, stream: str, entry_id: str) -> None:
    await r.xtrim(stream, maxlen=0)
    assert await r.xrange(stream, entry_id, entry_id) == []


async def _del_stream(r: Redis, stream: str, entry_id: str) -> None:
    assert await r.delete(stream) == 1


REMOVALS = pytest.mark.parametrize(
    "remove", [_xdel, _xtrim, _del_stream], ids=["xdel", "xtrim", "del_stream"]
)


@pytest.fixture
def quick_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's pass over the task hashes every 100 ms instead of every minute."""
    monkeypatch.setattr(scheduler, "PASS_EVERY_MS", 100)


class Recorder:
    """A handler recording (task id, attempt) of each run; it waits for ``release`` when set."""

    def __init__(self, release: asyncio.Event | None = None) -> None:
        self.runs: list[tuple[str, int]] = []
        self.running = asyncio.Event()
        self.release = release
        self.cancelled = False

    async def __call__(self, payload: dict[str, Any], ctx: TaskContext) -> str:
        self.runs.append((ctx.task_id, ctx.attempt))
        self.running.set()
        if self.release is not None:
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return "done"


async def _history(r: Redis, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in await r.lrange(keys.history(task_id), 0, -1)]


async def _pending(r: Redis, stream: str, entry_id: str) -> bool:
    try:
        rows = await r.xpending_range(stream, keys.CONSUMER_GROUP, entry_id, entry_id, 1)
    except Exception as exc:  # the stream (and its group) was deleted
        assert "NOGROUP" in str(exc), exc
        return False
    return bool(rows)


# -- queued ---------------------------------------------------------------------------------------


@REMOVALS
async def test_a_queued_task_whose_entry_was_removed_gets_a_new_one_and_runs(
    settings: Settings, r: Redis, queue: Queue, remove: Remove
) -> None:
    """Submitted with an idempotency key, its entry removed before any worker read it: the
    leader's pass writes a new entry (history QUEUED -> QUEUED, entry_lost), a worker runs it
    once, and the record ends completed."""
    task = await queue.submit("rm_job", {"n": 1}, idempotency_key="k-1")
    lost_id = (await r.hgetall(keys.task(task.task_id)))["entry_id"]
    await remove(r, STREAM, lost_id)
    job = Recorder()
    async with running_worker(fast(settings), handlers(rm_job=job)):
        done = await wait_status(r, task.task_id, "succeeded")
    assert job.runs == [(task.task_id, 1)]
    assert done["entry_id"] != lost_id and done["attempt"] == "1"
    lost = [e for e in await _history(r, task.task_id) if e.get("reason") == "entry_lost"]
    assert [(e["from"], e["to"], e["lost_entry_id"]) for e in lost] == [
        ("queued", "queued", lost_id)
    ]
    record = json.loads(await r.get(keys.idempotency("default", "k-1")))
    assert (record["task_id"], record["state"]) == (task.task_id, "completed")


async def test_the_pass_leaves_tasks_whose_entry_is_there_or_pending(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """One full pass over 300 queued tasks, one of them read by a consumer and then deleted
    (pending: its reader starts it): only the task whose entry is gone and held by nobody gets
    a new entry."""
    tasks = await queue.submit_many([{"task_type": "rm_job", "payload": {}}] * 300)
    held = await read_as(r, DEAD)
    await r.xdel(STREAM, held.entry_id)
    gone = tasks[-1].task_id
    gone_entry = (await r.hgetall(keys.task(gone)))["entry_id"]
    await r.xdel(STREAM, gone_entry)
    before = {t.task_id: await r.hget(keys.task(t.task_id), "entry_id") for t in tasks}
    assert await _full_pass(lost_entries.LostEntries(queue.store)) == [(gone, "queued")]
    after = {t.task_id: await r.hget(keys.task(t.task_id), "entry_id") for t in tasks}
    assert {t for t in after if after[t] != before[t]} == {gone}


# -- running, its worker alive --------------------------------------------------------------------


@REMOVALS
async def test_a_running_task_whose_entry_is_removed_finishes_once(
    settings: Settings, r: Redis, queue: Queue, remove: Remove
) -> None:
    """The entry of a running task is removed under its live worker. Heartbeats go on (Redis 7
    would drop the entry from the pending list at the next renewal): the handler is not
    cancelled, its success is recorded once, and nothing redelivers the task."""
    release = asyncio.Event()
    job = Recorder(release)
    s = fast(settings)
    async with running_worker(s, handlers(rm_job=job)) as w:
        task = await queue.submit("rm_job", {})
        await asyncio.wait_for(job.running.wait(), 10)
        entry_id = (await r.hgetall(keys.task(task.task_id)))["entry_id"]
        await remove(r, STREAM, entry_id)
        removed_ms = await redis_time_ms(r)

        async def beaten_past_the_visibility_timeout() -> bool:
            beat = await r.hget(keys.worker(w.worker_id), "last_heartbeat_ms")
            return int(beat or 0) > removed_ms + s.visibility_timeout_s * 1000

        # Heartbeats (and reaper passes) for longer than the visibility timeout.
        await wait_until(beaten_past_the_visibility_timeout, 10, "heartbeats after the removal")
        assert (await r.hgetall(keys.task(task.task_id)))["status"] == "running"
        assert not job.cancelled
        release.set()
        done = await wait_status(r, task.task_id, "succeeded")
        assert w.worker_id == done["worker_id"]
    assert job.runs == [(task.task_id, 1)]
    assert done["attempt"] == "1" and done["entry_id"] == entry_id
    steps = [(e["from"], e["to"]) for e in await _history(r, task.task_id)]
    assert steps == [(None, "queued"), ("queued", "running"), ("running", "succeeded")]


async def test_finish_of_a_removed_entry_is_fenced_unless_the_hash_names_this_worker(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """An entry removed and no longer pending: finish.lua records it only for the worker and
    attempt the hash names; another consumer's finish is fenced, and an entry still in its
    stream but not pending is fenced as before."""
    task = await queue.submit("rm_job", {})
    entry = await read_as(r, DEAD)
    await start_as(r, entry, DEAD, settings)
    await r.xdel(STREAM, entry.entry_id)
    await r.xack(STREAM, keys.CONSUMER_GROUP, entry.entry_id)  # what touch.lua does
    other = await finish_as(r, entry, 1, SUCCESS, "worker-other", settings)
    assert (other.status, other.detail) == ("fenced", "not_pending")
    wrong_attempt = await finish_as(r, entry, 2, SUCCESS, DEAD, settings)
    assert (wrong_attempt.status, wrong_attempt.detail) == ("fenced", "attempt")
    mine = await finish_as(r, entry, 1, SUCCESS, DEAD, settings)
    assert mine.status == "succeeded"
    assert (await r.hgetall(keys.task(task.task_id)))["status"] == "succeeded"

    second = await queue.submit("rm_job", {})
    kept = await read_as(r, DEAD)
    await start_as(r, kept, DEAD, settings)
    await r.xack(STREAM, keys.CONSUMER_GROUP, kept.entry_id)  # in the stream, not pending
    fenced = await finish_as(r, kept, 1, SUCCESS, DEAD, settings)
    assert (fenced.status, fenced.detail) == ("fenced", "not_pending")
    assert (await r.hgetall(keys.task(second.task_id)))["status"] == "running"


# -- running, its worker dead ---------------------------------------------------------------------


@REMOVALS
async def test_a_dead_workers_task_whose_entry_was_removed_is_redelivered(
    settings: Settings, r: Redis, queue: Queue, remove: Remove, quick_pass: None
) -> None:
    """A dead worker started the task; its entry is removed while pending. The reaper takes the
    id off the pending list (Redis 7 reports it deleted, 6.2 answers nil), the leader's pass
    finds the RUNNING task without an entry and its worker gone, and it is a crash redelivery:
    attempt 2 runs and succeeds."""
    task = await queue.submit("rm_job", {}, max_attempts=3)
    entry = await read_as(r, DEAD)
    await start_as(r, entry, DEAD, settings)
    await remove(r, STREAM, entry.entry_id)
    job = Recorder()
    async with running_worker(fast(settings), handlers(rm_job=job)):
        done = await wait_status(r, task.task_id, "succeeded")
    assert job.runs == [(task.task_id, 2)]
    assert done["attempt"] == "2" and done["entry_id"] != entry.entry_id
    steps = [(e["from"], e["to"], e.get("reason")) for e in await _history(r, task.task_id)]
    assert ("running", "running", "entry_lost") in steps
    assert ("running", "running", "redelivered") in steps
    assert not await _pending(r, STREAM, entry.entry_id)


async def test_a_dead_workers_last_attempt_whose_entry_was_removed_is_dead_lettered(
    settings: Settings, r: Redis, queue: Queue, quick_pass: None
) -> None:
    """The same with attempts exhausted: WorkerLost, in the dead-letter queue, never run."""
    task = await queue.submit("rm_job", {}, max_attempts=1)
    entry = await read_as(r, DEAD)
    await start_as(r, entry, DEAD, settings)
    await r.xdel(STREAM, entry.entry_id)
    job = Recorder()
    async with running_worker(fast(settings), handlers(rm_job=job)):
        done = await wait_status(r, task.task_id, "dead_lettered")
    assert job.runs == []
    assert done["error_class"] == "WorkerLost"
    [(_, dlq)] = await r.xrange(keys.DEAD_LETTER)
    assert (dlq["task_id"], dlq["last_error_class"]) == (task.task_id, "WorkerLost")


async def test_a_running_task_of_a_live_worker_is_not_redelivered(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """recover.lua leaves a RUNNING task whose entry is gone while its worker's hash is there
    (that worker finishes it on its hash), and redelivers it once the hash is gone."""
    task = await queue.submit("rm_job", {})
    entry = await read_as(r, DEAD)
    await start_as(r, entry, DEAD, settings)
    await r.xdel(STREAM, entry.entry_id)
    await r.xack(STREAM, keys.CONSUMER_GROUP, entry.entry_id)
    await r.hset(keys.worker(DEAD), mapping={"status": "busy", "worker_id": DEAD})
    pass_ = lost_entries.LostEntries(queue.store)
    assert await _full_pass(pass_) == []
    assert (await r.hgetall(keys.task(task.task_id)))["entry_id"] == entry.entry_id
    await r.delete(keys.worker(DEAD))
    assert await _full_pass(pass_) == [(task.task_id, "running")]


async def _full_pass(pass_: lost_entries.LostEntries) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    while True:
        got, done = await pass_.step()
        out += got
        if done:
            return out


# -- paused queues --------------------------------------------------------------------------------


@pytest.mark.parametrize("cancel", [False, True], ids=["redelivered", "cancelled"])
async def test_a_dead_workers_running_entry_on_a_paused_queue_is_recovered(
    settings: Settings, r: Redis, queue: Queue, cancel: bool
) -> None:
    """A dead worker was running a task of a queue that is paused now: the reaper still takes
    it over (it had started). It runs again as attempt 2, or, cancelled meanwhile, ends
    CANCELLED; the queue's waiting task stays waiting."""
    task = await queue.submit("rm_job", {}, queue="pq")
    entry = await read_as(r, DEAD, queue="pq")
    await start_as(r, entry, DEAD, settings)
    waiting = await queue.submit("rm_job", {}, queue="pq")
    await queue.pause_queue("pq")
    if cancel:
        with pytest.raises(TaskRunningError):  # requested: the task is running
            await queue.cancel(task.task_id)
    job = Recorder()
    async with running_worker(fast(settings), handlers(rm_job=job), queues=("pq",)):
        done = await wait_status(r, task.task_id, "cancelled" if cancel else "succeeded")
    assert job.runs == ([] if cancel else [(task.task_id, 2)])
    assert done["attempt"] == ("1" if cancel else "2")
    assert (await r.hgetall(keys.task(waiting.task_id)))["status"] == "queued"


async def test_an_entry_a_peer_took_over_and_finished_is_lost_to_the_zombie(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """Gone from its stream is not enough to keep a lease: a peer reclaimed the entry of a
    stalled worker and finished the task (acknowledged and deleted it). The stalled worker's
    touch reports it lost, so its handler is stopped; touch of an entry removed while the hash
    still names the worker does not."""
    task = await queue.submit("rm_job", {})
    entry = await read_as(r, DEAD)
    await start_as(r, entry, DEAD, settings)
    await r.xclaim(STREAM, keys.CONSUMER_GROUP, "worker-peer0000", 0, [entry.entry_id])
    taken = await start_as(r, entry, "worker-peer0000", settings)
    assert taken.attempt == 2
    assert (await finish_as(r, entry, 2, SUCCESS, "worker-peer0000", settings)).status == (
        "succeeded"
    )
    owned = [(STREAM, entry.entry_id, task.task_id)]
    assert await touch(queue.store, DEAD, owned) == [entry_key(STREAM, entry.entry_id)]

    running = await queue.submit("rm_job", {})
    mine = await read_as(r, DEAD)
    await start_as(r, mine, DEAD, settings)
    await r.xdel(STREAM, mine.entry_id)
    owned = [(STREAM, mine.entry_id, running.task_id)]
    assert await touch(queue.store, DEAD, owned) == []  # acknowledged now
    assert not await _pending(r, STREAM, mine.entry_id)
    assert await touch(queue.store, DEAD, owned) == []  # and still held on the hash
    assert await touch(queue.store, "worker-other", owned) == [entry_key(STREAM, mine.entry_id)]
