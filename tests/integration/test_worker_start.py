"""The start checks of start.lua, each branch through a real worker (contract section 6,
DESIGN 4): missing hash, terminal, cancelled, duplicate, crash redelivery, attempts exhausted
(WorkerLost), expired. Crashes are simulated deterministically by taking a consumer's identity:
an entry read (and started) as consumer W is redelivered to the worker started with id W, or
reclaimed by another worker after the visibility timeout."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, calls, keys
from dtq.config import Settings
from dtq_tasks import TaskContext
from support import Events, running_worker, wait_until
from support.worker import (
    DLQ_FIELDS,
    fast,
    handlers,
    past_deadline,
    read_as,
    start_as,
    stream_empty,
    wait_status,
)

pytestmark = pytest.mark.backends("single", "cluster")


class Recorder:
    """A handler that records each call (task id, attempt)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        self.calls.append((ctx.task_id, ctx.attempt))
        return {"ok": True}


async def test_missing_hash_entry_is_acked_and_deleted(settings: Settings, r: Redis) -> None:
    """Entries of no task: one with an id of the queue (its hash gone), and foreign writes, an
    id or a queue that is not the stream's (on a cluster, keys of another slot, which no script
    could serve). Each is consumed once and never run, never retried forever."""
    stream = keys.stream("default", 5)
    await r.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    for task_id, queue in (
        (calls.new_task_id("default"), "default"),
        ("0" * 32, "default"),
        (calls.new_task_id("default"), "elsewhere"),
    ):
        await r.xadd(
            stream,
            {
                "task_id": task_id,
                "queue": queue,
                "task_type": "wt_echo",
                "payload": "{}",
                "attempt": "1",
                "max_attempts": "3",
                "priority": "5",
                "timeout_ms": "1000",
                "idempotency_key": "",
            },
        )
    rec = Recorder()
    async with running_worker(fast(settings), handlers(wt_echo=rec)):
        await wait_until(lambda: stream_empty(r, stream), 5, "entry consumed")
    assert rec.calls == []


async def test_terminal_task_entry_is_acked_without_running(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    rec = Recorder()
    s = fast(settings)
    task = await queue.submit("wt_echo", {})
    stream = keys.stream("default", 5)
    async with running_worker(s, handlers(wt_echo=rec)):
        await wait_status(r, task.task_id, "succeeded")
        # A stray second entry of a finished task: the terminal check comes first.
        await r.xadd(
            stream,
            {
                "task_id": task.task_id,
                "queue": "default",
                "task_type": "wt_echo",
                "payload": "{}",
                "attempt": "2",
                "max_attempts": "5",
                "priority": "5",
                "timeout_ms": "1000",
                "idempotency_key": "",
            },
        )
        await wait_until(lambda: stream_empty(r, stream), 5, "stray entry consumed")
    assert rec.calls == [(task.task_id, 1)]
    assert (await r.hgetall(keys.task(task.task_id)))["status"] == "succeeded"


async def test_start_reply_kinds_for_terminal_and_missing(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """The script's own answers, driven directly."""
    task = await queue.submit("wt_echo", {})
    entry = await read_as(r, "worker-aaaaaaaa")
    await r.hset(keys.task(task.task_id), "status", "succeeded")
    assert (await start_as(r, entry, "worker-aaaaaaaa", settings)).kind == "terminal"
    assert await stream_empty(r, entry.stream)

    other = await queue.submit("wt_echo", {})
    entry = await read_as(r, "worker-aaaaaaaa")
    await r.delete(keys.task(other.task_id))
    assert (await start_as(r, entry, "worker-aaaaaaaa", settings)).kind == "missing"
    assert await stream_empty(r, entry.stream)


async def test_cancelled_while_delivered_is_acked_and_never_runs(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """An entry delivered to worker W but not started when the task is cancelled stays in W's
    pending list (cancel cannot delete it); W's start check sees CANCELLED, ACKs and deletes
    it, and clears dtq:cancelled."""
    me = "worker-cafecafe"
    task = await queue.submit("wt_echo", {})
    entry = await read_as(r, me)
    cancelled = await queue.cancel(task.task_id)
    assert cancelled.status == "cancelled"
    assert await r.sismember(keys.cancelled("default"), task.task_id)
    assert await r.xlen(entry.stream) == 1  # left for its consumer
    rec = Recorder()
    async with running_worker(
        fast(settings, visibility_timeout_s=0.5), handlers(wt_echo=rec), worker_id=me
    ):
        await wait_until(lambda: stream_empty(r, entry.stream), 5, "cancelled entry consumed")
    assert rec.calls == []
    assert not await r.sismember(keys.cancelled("default"), task.task_id)
    assert (await queue.get(task.task_id)).status == "cancelled"


async def test_forced_duplicate_is_absorbed_and_task_runs_once(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    task = await queue.submit("wt_echo", {"n": 1})
    stream = keys.stream("default", 5)
    fields = (await r.xrange(stream))[0][1]
    dup_id = await r.xadd(stream, fields)  # a second entry of the same task
    rec = Recorder()
    async with (
        Events(r) as events,
        running_worker(fast(settings), handlers(wt_echo=rec)),
    ):
        await wait_status(r, task.task_id, "succeeded")
        await wait_until(lambda: stream_empty(r, stream), 5, "duplicate consumed")
        await wait_until(lambda: _has(events, "TASK_DUPLICATE_ABSORBED", task.task_id), 5, "ev")
    assert rec.calls == [(task.task_id, 1)]
    absorbed = events.of("TASK_DUPLICATE_ABSORBED", task.task_id)
    assert len(absorbed) == 1
    assert absorbed[0].metadata["entry_id"] == dup_id
    assert absorbed[0].metadata["live_entry_id"] == task.entry_id
    history = await queue.history(task.task_id)
    assert [h.to_status for h in history] == ["queued", "running", "succeeded"]


async def _has(events: Events, etype: str, task_id: str) -> bool:
    return bool(events.of(etype, task_id))


async def test_crash_redelivery_runs_again_as_next_attempt(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """Worker D read and started the task (RUNNING, attempt 1) and died. After the visibility
    timeout another worker's reaper claims the entry: the start check counts a new attempt in
    the hash (never from the delivery counter) and runs it."""
    task = await queue.submit("wt_echo", {}, max_attempts=3)
    entry = await read_as(r, "worker-deaddead")
    started = await start_as(r, entry, "worker-deaddead", settings)
    assert (started.kind, started.attempt) == ("run", 1)
    rec = Recorder()
    async with running_worker(fast(settings, visibility_timeout_s=0.5), handlers(wt_echo=rec)) as w:
        h = await wait_status(r, task.task_id, "succeeded")
    assert rec.calls == [(task.task_id, 2)]
    assert h["attempt"] == "2" and h["worker_id"] == w.worker_id
    history = await queue.history(task.task_id)
    redelivered = [x for x in history if x.reason == "redelivered"]
    assert len(redelivered) == 1
    assert (redelivered[0].from_status, redelivered[0].to_status) == ("running", "running")
    assert await stream_empty(r, entry.stream)


async def test_redelivery_past_max_attempts_is_dead_lettered_worker_lost(
    settings: Settings, r: Redis, queue: Queue, redis_url: str
) -> None:
    task = await queue.submit("wt_echo", {"x": 1}, max_attempts=1, idempotency_key="k-lost")
    entry = await read_as(r, "worker-deaddead")
    await start_as(r, entry, "worker-deaddead", settings)
    rec = Recorder()
    async with (
        Events(r) as events,
        running_worker(fast(settings, visibility_timeout_s=0.5), handlers(wt_echo=rec)),
    ):
        h = await wait_status(r, task.task_id, "dead_lettered")
        await wait_until(lambda: _has(events, "TASK_DEAD_LETTERED", task.task_id), 5, "ev")
    assert rec.calls == []
    assert h["error_class"] == "WorkerLost"
    dlq = await r.xrange(keys.dead_letter("default"))
    assert len(dlq) == 1
    dlq_id, fields = dlq[0]
    assert set(fields) == DLQ_FIELDS
    assert h["dlq_entry_id"] == dlq_id
    assert fields["last_error_class"] == "WorkerLost"
    assert fields["attempts_made"] == "1" and fields["worker_id"] == "worker-deaddead"
    assert fields["original_queue"] == "default" and json.loads(fields["payload"]) == {"x": 1}
    idem = json.loads(await r.get(keys.idempotency("default", "k-lost")))
    assert idem["state"] == "failed"
    assert await stream_empty(r, entry.stream)


async def test_worker_lost_with_dlq_disabled_is_failed(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit("wt_echo", {}, max_attempts=1)
    entry = await read_as(r, "worker-deaddead")
    await start_as(r, entry, "worker-deaddead", settings)
    s = fast(settings, visibility_timeout_s=0.5, dlq_enabled=False)
    async with running_worker(s, handlers(wt_echo=Recorder())):
        h = await wait_status(r, task.task_id, "failed")
    assert h["error_class"] == "WorkerLost"
    assert await r.xlen(keys.dead_letter("default")) == 0


async def test_cancel_requested_before_crash_is_cancelled_on_redelivery(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit("wt_echo", {})
    entry = await read_as(r, "worker-deaddead")
    await start_as(r, entry, "worker-deaddead", settings)
    await r.hset(keys.task(task.task_id), "cancel_requested", "1")
    rec = Recorder()
    async with running_worker(fast(settings, visibility_timeout_s=0.5), handlers(wt_echo=rec)):
        await wait_status(r, task.task_id, "cancelled")
    assert rec.calls == []


async def test_expired_entry_is_marked_expired_and_never_runs(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """The start check itself (driven directly), then through a worker."""
    task = await queue.submit("wt_echo", {}, ttl_seconds=0.05, idempotency_key="k-exp")
    await past_deadline(queue, task.expires_at)
    entry = await read_as(r, "worker-aaaaaaaa")
    reply = await start_as(r, entry, "worker-aaaaaaaa", settings)
    assert reply.kind == "expired"
    h = await r.hgetall(keys.task(task.task_id))
    assert h["status"] == "expired" and h["expired_at"]
    assert await stream_empty(r, entry.stream)
    assert await r.zscore(keys.expiry("default"), task.task_id) is None
    assert json.loads(await r.get(keys.idempotency("default", "k-exp")))["state"] == "failed"

    rec = Recorder()
    others = [await queue.submit("wt_echo", {}, ttl_seconds=0.05) for _ in range(5)]
    await past_deadline(queue, others[-1].expires_at)
    async with running_worker(fast(settings), handlers(wt_echo=rec)):
        for t in others:
            await wait_status(r, t.task_id, "expired")
    assert rec.calls == []


async def test_redelivered_running_task_runs_even_past_its_deadline(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit("wt_echo", {}, ttl_seconds=0.3)
    entry = await read_as(r, "worker-deaddead")
    await start_as(r, entry, "worker-deaddead", settings)
    rec = Recorder()
    async with running_worker(fast(settings, visibility_timeout_s=0.5), handlers(wt_echo=rec)):
        await wait_status(r, task.task_id, "succeeded")
    assert rec.calls == [(task.task_id, 2)]


async def test_start_sets_running_fields_and_removes_expiry_member(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit("wt_echo", {}, ttl_seconds=60, timeout_ms=1234)
    assert await r.zscore(keys.expiry("default"), task.task_id) is not None
    entry = await read_as(r, "worker-aaaaaaaa")
    reply = await start_as(r, entry, "worker-aaaaaaaa", settings)
    assert reply.kind == "run" and reply.attempt == 1 and reply.timeout_ms == 1234
    assert reply.expires_at_ms is not None and reply.started_ms > 0
    h = await r.hgetall(keys.task(task.task_id))
    assert h["status"] == "running" and h["attempt"] == "1"
    assert h["worker_id"] == "worker-aaaaaaaa" and h["started_at"]
    assert (
        await r.zscore(keys.expiry("default"), task.task_id) is None
    )  # a started task never expires


async def test_queued_task_listed_as_cancelled_is_cancelled_at_start(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """The safety net of check 4: a QUEUED task in dtq:cancelled is cancelled, not run."""
    task = await queue.submit("wt_echo", {}, idempotency_key="k-net")
    await r.sadd(keys.cancelled("default"), task.task_id)
    entry = await read_as(r, "worker-aaaaaaaa")
    reply = await start_as(r, entry, "worker-aaaaaaaa", settings)
    assert (reply.kind, reply.detail) == ("cancelled", "queued")
    assert (await queue.get(task.task_id)).status == "cancelled"
    assert not await r.sismember(keys.cancelled("default"), task.task_id)
    assert await stream_empty(r, entry.stream)
    assert json.loads(await r.get(keys.idempotency("default", "k-net")))["state"] == "failed"


async def test_undecodable_payload_is_a_permanent_error(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """An entry whose payload is not a JSON object (a foreign writer): PayloadDecodeError."""
    rec = Recorder()
    results = {}
    for name, payload in (("not_json", "{nope"), ("not_object", "[1, 2]")):
        task = await queue.submit("wt_echo", {})
        stream = keys.stream("default", 5)
        fields = dict((await r.xrange(stream, task.entry_id, task.entry_id))[0][1])
        await r.xdel(stream, task.entry_id)
        fields["payload"] = payload
        forged = await r.xadd(stream, fields)
        await r.hset(keys.task(task.task_id), "entry_id", forged)
        results[name] = task.task_id
    async with running_worker(fast(settings), handlers(wt_echo=rec)):
        for task_id in results.values():
            h = await wait_status(r, task_id, "dead_lettered")
            assert h["error_class"] == "PayloadDecodeError" and h["attempt"] == "1"
    assert rec.calls == []
