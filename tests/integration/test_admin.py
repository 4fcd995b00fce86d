"""Operator operations of dtq.admin and the SDK (contract sections 11-13, DESIGN 10) on a real
Redis: audit entries written by the script that makes the change, dead letters (list, get,
requeue, discard, purge), pause/resume, queue purge, queue statistics, workers, audit log.

Dead-lettered state is written here exactly as the worker's finish script writes it (hash status
dead_lettered with the error fields and dlq_entry_id, an entry in dtq:stream:dead-letter with
the contract's fields), so these tests do not depend on a running worker.
"""

from __future__ import annotations

import json

import pytest
from redis.asyncio import Redis

from dtq import Audit, Queue, TaskStatus, admin, calls, connect_sync, keys
from dtq.config import Settings
from dtq.errors import (
    InvalidTaskError,
    InvalidTransitionError,
    NotInDeadLetterError,
    TaskNotFoundError,
    TaskRunningError,
    TaskTerminalError,
    WorkerNotFoundError,
)
from dtq.models import format_ts, parse_ts
from support import Events

pytestmark = pytest.mark.backends("single", "cluster")

MISSING_ID = "f" * 32
OPERATOR = Audit(actor="cli:ops@host", request_id="req-1")


# -- helpers ------------------------------------------------------------------------------------


async def redis_ms(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def dead_letter(
    r: Redis,
    task_id: str,
    *,
    attempts: int = 3,
    error_class: str = "ValueError",
    error: str = "boom",
    worker_id: str = "worker-0badf00d",
    write_entry_id: bool = True,
) -> str:
    """Put a queued task into the dead-letter state as the worker's finish script does:
    its stream entry acknowledged and deleted, the hash DEAD_LETTERED with the error fields,
    a DLQ entry with the contract's fields, dlq_entry_id, idempotency state failed."""
    h = await r.hgetall(keys.task(task_id))
    stream = keys.stream(h["queue"], int(h["priority"]))
    if h.get("entry_id"):
        await r.xdel(stream, h["entry_id"])
    now = await redis_ms(r)
    entry_id = await r.xadd(
        keys.dead_letter(h["queue"]),
        {
            "task_id": task_id,
            "queue": h["queue"],
            "task_type": h["task_type"],
            "payload": h["payload"],
            "attempt": attempts,
            "max_attempts": h["max_attempts"],
            "priority": h["priority"],
            "timeout_ms": h["timeout_ms"],
            "idempotency_key": h["idempotency_key"],
            "failed_at_ms": now,
            "attempts_made": attempts,
            "last_error": error,
            "last_error_class": error_class,
            "retryable": "0",
            "worker_id": worker_id,
            "original_queue": h["queue"],
        },
        maxlen=10_000,
        approximate=True,
    )
    fields = {
        "status": "dead_lettered",
        "attempt": attempts,
        "started_at": format_ts(now - 5),
        "finished_at": format_ts(now),
        "updated_at": format_ts(now),
        "duration_ms": 5,
        "worker_id": worker_id,
        "error_class": error_class,
        "error_message": error,
        "retryable": "0",
    }
    if write_entry_id:
        fields["dlq_entry_id"] = entry_id
    await r.hset(keys.task(task_id), mapping=fields)
    if h["idempotency_key"]:
        key = keys.idempotency(h["queue"], h["idempotency_key"])
        record = {"task_id": task_id, "state": "failed", "updated_at": format_ts(now)}
        await r.set(key, json.dumps(record), keepttl=True)
    return str(entry_id)


async def deliver(r: Redis, task_id: str, *, start: bool) -> str:
    """Deliver the task's entry to a consumer (it enters the PEL); ``start`` marks it RUNNING as
    the start script would."""
    h = await r.hgetall(keys.task(task_id))
    stream = keys.stream(h["queue"], int(h["priority"]))
    got = await r.xreadgroup(keys.CONSUMER_GROUP, "worker-c0ffee00", {stream: ">"}, count=1)
    entry_id = got[0][1][0][0]
    assert entry_id == h["entry_id"], "deliver() expects the task to be next in its stream"
    if start:
        now = format_ts(await redis_ms(r))
        await r.hset(
            keys.task(task_id),
            mapping={"status": "running", "attempt": 1, "started_at": now, "worker_id": "w1"},
        )
    return str(entry_id)


async def audit_entries(r: Redis, *queues: str) -> list[dict[str, str]]:
    """The audit entries of operations on ``queues`` (``default`` if none), each audit stream
    oldest first (one stream in the flat layout, one per queue on a cluster)."""
    found = []
    for scope in keys.scopes(queues or ("default",)):
        found += [fields for _, fields in await r.xrange(keys.audit(scope))]
    return found


# -- audit: cancel and expire -------------------------------------------------------------------


async def test_cancel_with_audit_writes_one_entry_in_the_same_script(
    queue: Queue, r: Redis
) -> None:
    task = await queue.submit("echo_task", {}, queue="mail")
    assert await admin.cancel(queue.store, task.task_id, audit=OPERATOR) == "queued"
    [entry] = await audit_entries(r, "mail")
    h = await r.hgetall(keys.task(task.task_id))
    assert entry == {
        "actor": "cli:ops@host",
        "action": "cancel",
        "task_id": task.task_id,
        "queue": "mail",
        "ts": h["updated_at"],  # the script's own clock reading: one atomic step
        "request_id": "req-1",
    }
    # A refusal changes nothing and is not audited; no audit object, no entry.
    with pytest.raises(TaskTerminalError):
        await admin.cancel(queue.store, task.task_id, audit=OPERATOR)
    other = await queue.submit("echo_task", {})
    await admin.cancel(queue.store, other.task_id)
    assert len(await audit_entries(r, "mail", "default")) == 1


async def test_cancel_running_is_audited_as_a_request(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {})
    await deliver(r, task.task_id, start=True)
    with pytest.raises(TaskRunningError):
        await queue.cancel(task.task_id, audit=Audit("api:key1"))
    assert await r.hget(keys.task(task.task_id), "cancel_requested") == "1"
    [entry] = await audit_entries(r)
    assert entry["action"] == "cancel" and entry["actor"] == "api:key1"
    assert entry["request_id"] == "" and entry["task_id"] == task.task_id


async def test_expire_with_audit(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {}, delay_seconds=60)
    got = await queue.mark_expired(task.task_id, audit=OPERATOR)
    assert got.status is TaskStatus.EXPIRED
    [entry] = await audit_entries(r)
    assert entry["action"] == "expire" and entry["task_id"] == task.task_id
    assert entry["ts"] == await r.hget(keys.task(task.task_id), "expired_at")
    with pytest.raises(InvalidTransitionError):
        await queue.mark_expired(task.task_id, audit=OPERATOR)
    assert len(await audit_entries(r)) == 1


def test_audit_needs_an_actor() -> None:
    with pytest.raises(ValueError, match="actor"):
        Audit(actor="")


# -- dead letters: list and get -----------------------------------------------------------------


async def test_dlq_list_newest_first_and_get(queue: Queue, r: Redis) -> None:
    ids = []
    for i in range(3):
        task = await queue.submit("echo_task", {"i": i}, queue="mail", idempotency_key=f"k{i}")
        await dead_letter(r, task.task_id, error=f"boom {i}")
        ids.append(task.task_id)
    listed = await queue.dlq_list()
    assert [d.task_id for d in listed] == ids[::-1]
    assert [d.task_id for d in await queue.dlq_list(limit=2)] == ids[:0:-1]
    dl = await queue.dlq_get(ids[1])
    assert dl.task_id == ids[1] and dl.queue == "mail" and dl.original_queue == "mail"
    assert dl.payload == {"i": 1} and dl.last_error == "boom 1"
    assert dl.last_error_class == "ValueError" and dl.attempts_made == 3 and dl.attempt == 3
    assert dl.idempotency_key == "k1" and dl.retryable is False
    assert dl.worker_id == "worker-0badf00d" and dl.failed_at is not None
    assert dl.entry_id == await r.hget(keys.task(ids[1]), "dlq_entry_id")


async def test_dlq_get_falls_back_to_a_scan(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {})
    entry_id = await dead_letter(r, task.task_id, write_entry_id=False)
    # Many newer entries: the scan goes back through more than one chunk.
    pipe = r.pipeline(transaction=False)
    for i in range(admin.CHUNK * 11):
        pipe.xadd(keys.dead_letter("default"), {"task_id": f"other{i}", "queue": "default"})
    await pipe.execute()
    assert (await admin.dlq_get(queue.store, task.task_id)).entry_id == entry_id


async def test_dlq_get_errors(queue: Queue, r: Redis) -> None:
    with pytest.raises(NotInDeadLetterError, match="does not exist"):
        await queue.dlq_get(MISSING_ID)
    task = await queue.submit("echo_task", {})
    with pytest.raises(NotInDeadLetterError, match="queued") as info:
        await queue.dlq_get(task.task_id)
    assert info.value.code == "NOT_IN_DLQ" and info.value.details["status"] == "queued"


# -- dead letters: requeue ----------------------------------------------------------------------


async def test_requeue_starts_a_new_life(queue: Queue, r: Redis) -> None:
    meta = {"tags": [], "big": 12345678901234567, "nested": {"empty": {}}}
    task = await queue.submit(
        "echo_task", {"n": 1}, queue="mail", priority=7, idempotency_key="order-1", metadata=meta
    )
    dlq_id = await dead_letter(r, task.task_id, attempts=4, error="disk full")
    async with Events(r) as events:
        got = await queue.requeue_dead_letter(task.task_id, audit=OPERATOR)
        evs = await events.sync()
    assert got.status is TaskStatus.QUEUED and got.attempt == 0
    assert got.error_class is None and got.worker_id is None and got.finished_at is None
    # The user's metadata survives byte for byte ([] stays a list, big ints stay exact).
    assert {k: got.metadata[k] for k in meta} == meta
    [prev] = got.metadata["previous_attempts"]
    assert prev["attempts"] == 4 and prev["last_error"] == "disk full"
    assert prev["last_error_class"] == "ValueError" and prev["worker_id"] == "worker-0badf00d"
    assert parse_ts(prev["failed_at"]) is not None
    # DLQ entry gone; one new entry, attempt 1, in the task's priority stream (group there).
    assert await r.xrange(keys.dead_letter("mail"), dlq_id, dlq_id) == []
    [(entry_id, fields)] = await r.xrange(keys.stream("mail", 7))
    assert entry_id == got.entry_id and fields["attempt"] == "1"
    assert fields["task_id"] == task.task_id and fields["idempotency_key"] == "order-1"
    groups = await r.xinfo_groups(keys.stream("mail", 7))
    assert groups[0]["name"] == keys.CONSUMER_GROUP
    record = json.loads(await r.get(keys.idempotency("mail", "order-1")))
    assert record["state"] == "processing" and record["task_id"] == task.task_id
    assert await r.hget(keys.task(task.task_id), "dlq_entry_id") is None
    last = (await queue.history(task.task_id))[-1]
    assert last.from_status is TaskStatus.DEAD_LETTERED and last.to_status is TaskStatus.QUEUED
    assert last.reason == "dlq_requeue"
    [ev] = [e for e in evs if e["task_id"] == task.task_id]
    assert ev["type"] == "TASK_QUEUED" and ev["metadata"] == {"requeued": True}
    [entry] = await audit_entries(r, "mail")
    assert entry["action"] == "dlq_requeue" and entry["task_id"] == task.task_id
    assert entry["ts"] == await r.hget(keys.task(task.task_id), "updated_at")


async def test_requeue_twice_keeps_every_earlier_life(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {})
    await dead_letter(r, task.task_id, attempts=5, error="first")
    await queue.requeue_dead_letter(task.task_id)
    await dead_letter(r, task.task_id, attempts=2, error="second", write_entry_id=False)
    got = await queue.requeue_dead_letter(task.task_id)  # its DLQ entry found by a scan
    assert [p["last_error"] for p in got.metadata["previous_attempts"]] == ["first", "second"]
    assert [p["attempts"] for p in got.metadata["previous_attempts"]] == [5, 2]
    assert await r.xlen(keys.dead_letter("default")) == 0
    assert await r.xlen(keys.stream("default", 5)) == 1


async def test_requeue_keeps_a_deadline_ahead_and_refuses_a_passed_one(
    queue: Queue, r: Redis
) -> None:
    ahead = await queue.submit("echo_task", {}, ttl_seconds=3600)
    await dead_letter(r, ahead.task_id)
    await queue.requeue_dead_letter(ahead.task_id)
    assert await r.zscore(keys.expiry("default"), ahead.task_id) is not None

    passed = await queue.submit("echo_task", {}, ttl_seconds=3600)
    await dead_letter(r, passed.task_id)
    await r.hset(keys.task(passed.task_id), "expires_at_ms", await redis_ms(r) - 1)
    with pytest.raises(InvalidTransitionError, match="deadline"):
        await queue.requeue_dead_letter(passed.task_id, audit=OPERATOR)
    assert await r.hget(keys.task(passed.task_id), "status") == "dead_lettered"
    assert await r.xlen(keys.dead_letter("default")) == 1
    assert await audit_entries(r) == []


async def test_requeue_errors(queue: Queue, r: Redis) -> None:
    with pytest.raises(TaskNotFoundError):
        await queue.requeue_dead_letter(MISSING_ID)
    queued = await queue.submit("echo_task", {})
    with pytest.raises(NotInDeadLetterError, match="it is queued"):
        await queue.requeue_dead_letter(queued.task_id)
    expired = await queue.submit("echo_task", {}, ttl_seconds=0)
    with pytest.raises(NotInDeadLetterError, match="expired means too late"):
        await queue.requeue_dead_letter(expired.task_id)
    succeeded = await queue.submit("echo_task", {})
    await r.hset(keys.task(succeeded.task_id), "status", "succeeded")
    with pytest.raises(NotInDeadLetterError, match="succeeded"):
        await queue.requeue_dead_letter(succeeded.task_id, audit=OPERATOR)
    assert await audit_entries(r) == []


# -- dead letters: discard and purge ------------------------------------------------------------


async def test_discard_keeps_the_hash(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {}, metadata={"tags": []})
    dlq_id = await dead_letter(r, task.task_id)
    got = await queue.discard_dead_letter(task.task_id, audit=OPERATOR)
    assert got.status is TaskStatus.DEAD_LETTERED
    assert got.metadata == {"tags": [], "discarded": True}
    assert got.error_message == "boom" and got.attempt == 3
    assert await r.xrange(keys.dead_letter("default"), dlq_id, dlq_id) == []
    assert await r.ttl(keys.task(task.task_id)) > 0
    last = (await queue.history(task.task_id))[-1]
    assert last.reason == "dlq_discard" and last.to_status is TaskStatus.DEAD_LETTERED
    [entry] = await audit_entries(r)
    assert entry["action"] == "dlq_discard" and entry["task_id"] == task.task_id
    with pytest.raises(NotInDeadLetterError, match="discarded"):
        await queue.discard_dead_letter(task.task_id)
    with pytest.raises(NotInDeadLetterError, match="discarded"):
        await queue.dlq_get(task.task_id)
    with pytest.raises(NotInDeadLetterError, match="discarded"):
        await queue.requeue_dead_letter(task.task_id)
    with pytest.raises(TaskNotFoundError):
        await queue.discard_dead_letter(MISSING_ID)


async def test_discard_without_dlq_entry_id_scans(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {})
    await dead_letter(r, task.task_id, write_entry_id=False)
    await admin.dlq_discard(queue.store, task.task_id)
    assert await r.xlen(keys.dead_letter("default")) == 0


async def test_dlq_purge_in_chunks_marks_every_task(queue: Queue, r: Redis) -> None:
    n = admin.CHUNK * 2 + 17
    results = await queue.submit_many([{"task_type": "echo_task", "payload": {}}] * n)
    ids = [t.task_id for t in results if not isinstance(t, Exception)]
    for tid in ids:
        await dead_letter(r, tid)
    gone = calls.new_task_id("default")  # the queue's slot on a cluster
    await r.xadd(keys.dead_letter("default"), {"task_id": gone, "queue": "default"})  # hash gone
    assert await queue.purge_dead_letters(audit=OPERATOR) == n + 1
    assert await r.xlen(keys.dead_letter("default")) == 0
    pipe = r.pipeline(transaction=False)
    for tid in ids:
        pipe.hmget(keys.task(tid), "status", "metadata")
    for status, meta in await pipe.execute():
        assert status == "dead_lettered" and json.loads(meta) == {"discarded": True}
    [entry] = await audit_entries(r)
    assert entry["action"] == "dlq_purge" and entry["task_id"] == ""


async def test_dlq_purge_of_an_empty_dlq_is_still_audited(queue: Queue, r: Redis) -> None:
    assert await queue.purge_dead_letters(audit=OPERATOR) == 0
    assert [e["action"] for e in await audit_entries(r)] == ["dlq_purge"]
    assert await queue.purge_dead_letters() == 0
    assert len(await audit_entries(r)) == 1


# -- pause and resume ---------------------------------------------------------------------------


async def test_pause_and_resume(queue: Queue, r: Redis) -> None:
    async with Events(r) as events:
        assert await queue.pause_queue("mail", audit=OPERATOR) is True
        assert await queue.pause_queue("mail", audit=OPERATOR) is False
        assert await r.get(keys.queue_paused("mail")) == "1"
        assert (await queue.queue_stats("mail")).paused is True
        assert "mail" in await queue.store.queues()  # listed before its first task
        assert await queue.resume_queue("mail", audit=OPERATOR) is True
        assert await queue.resume_queue("mail") is False
        assert await r.exists(keys.queue_paused("mail")) == 0
        evs = await events.sync()
    assert [(e["type"], e["queue"], e["metadata"]) for e in evs] == [
        ("CONFIGURATION_CHANGED", "mail", {"queue": "mail", "paused": True}),
        ("CONFIGURATION_CHANGED", "mail", {"queue": "mail", "paused": False}),
    ]
    assert evs[0]["task_id"] is None
    entries = await audit_entries(r, "mail")
    assert [(e["action"], e["queue"], e["task_id"]) for e in entries] == [
        ("queue_pause", "mail", ""),
        ("queue_pause", "mail", ""),
        ("queue_resume", "mail", ""),
    ]
    with pytest.raises(InvalidTaskError, match="queue"):
        await queue.pause_queue("Bad Name")


# -- purge a queue ------------------------------------------------------------------------------


async def test_purge_queue_cancels_what_has_not_started(queue: Queue, r: Redis) -> None:
    running = await queue.submit("echo_task", {}, queue="mail", priority=9)
    await deliver(r, running.task_id, start=True)
    delivered = await queue.submit("echo_task", {}, queue="mail", priority=9)
    delivered_entry = await deliver(r, delivered.task_id, start=False)
    waiting = await queue.submit_many(
        [
            {"task_type": "echo_task", "payload": {"i": i}, "priority": i % 10}
            for i in range(admin.CHUNK + 30)
        ],
        queue="mail",
        ttl_seconds=600,
        metadata={"tags": []},
    )
    delayed = await queue.submit("echo_task", {}, queue="mail", delay_seconds=600)
    retrying = await queue.submit("echo_task", {}, queue="mail", idempotency_key="r1")
    await r.xdel(keys.stream("mail", 5), retrying.entry_id or "")
    await r.hset(keys.task(retrying.task_id), mapping={"status": "retrying", "attempt": 1})
    await r.zadd(keys.retry_schedule("mail"), {retrying.task_id: await redis_ms(r) + 60_000})
    other = await queue.submit("echo_task", {}, queue="other")
    other_delayed = await queue.submit("echo_task", {}, queue="other", delay_seconds=600)

    assert await queue.purge_queue("mail", audit=OPERATOR) == len(waiting) + 3

    gone = [t.task_id for t in waiting if not isinstance(t, Exception)]
    gone += [delayed.task_id, retrying.task_id, delivered.task_id]
    for tid in gone:
        got = await queue.get(tid)
        assert got.status is TaskStatus.CANCELLED and got.metadata["purged"] is True
        assert (await queue.history(tid))[-1].reason == "purge"
    assert (await queue.get(waiting[0].task_id)).metadata["tags"] == []  # type: ignore[union-attr]
    # Nothing is left behind: no waiting entries, schedule or expiry members of the purged.
    remaining = {}
    for stream in keys.queue_streams("mail"):
        for eid, fields in await r.xrange(stream):
            remaining[eid] = fields["task_id"]
    assert remaining == {running.entry_id: running.task_id, delivered_entry: delivered.task_id}
    assert await r.sismember(keys.cancelled("mail"), delivered.task_id)  # its consumer ACKs it
    scheduled = [
        member
        for scope in keys.scopes(("mail", "other"))
        for member in await r.zrange(keys.retry_schedule(scope), 0, -1)
    ]
    assert scheduled == [other_delayed.task_id]
    assert await r.zcard(keys.expiry("mail")) == 0
    record = json.loads(await r.get(keys.idempotency("mail", "r1")))
    assert record["state"] == "failed"
    # Running and other queues untouched.
    assert (await queue.get(running.task_id)).status is TaskStatus.RUNNING
    assert (await queue.get(other.task_id)).status is TaskStatus.QUEUED
    assert (await queue.get(other_delayed.task_id)).status is TaskStatus.PENDING
    [entry] = await audit_entries(r, "mail")
    assert entry == {
        "actor": "cli:ops@host",
        "action": "purge",
        "task_id": "",
        "queue": "mail",
        "ts": entry["ts"],
        "request_id": "req-1",
    }
    stats = await queue.queue_stats("mail")
    assert stats.depth == 2 and stats.pending == 2 and stats.waiting == 0
    assert stats.retry_scheduled == 0


async def test_purge_queue_events_and_empty_queue(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {}, queue="mail")
    async with Events(r) as events:
        assert await queue.purge_queue("mail") == 1
        evs = await events.sync()
    [ev] = evs
    assert ev["type"] == "TASK_CANCELLED" and ev["task_id"] == task.task_id
    assert ev["metadata"] == {"from": "queued", "purged": True}
    assert await audit_entries(r, "mail") == []  # no audit object, no entry
    assert await queue.purge_queue("mail", audit=OPERATOR) == 0
    assert [e["action"] for e in await audit_entries(r, "mail")] == ["purge"]
    with pytest.raises(InvalidTaskError):
        await queue.purge_queue("no/such")


async def test_purge_queue_removes_orphans(queue: Queue, r: Redis) -> None:
    """An entry or schedule member whose task record expired is removed too."""
    await queue.store.ensure_groups("mail")
    # ids of the queue's slot on a cluster, as every task of the queue has
    orphans = [calls.new_task_id("mail") for _ in range(2)]
    await r.xadd(keys.stream("mail", 5), {"task_id": orphans[0], "queue": "mail"})
    await r.zadd(keys.retry_schedule("mail"), {orphans[1]: 1})
    assert await queue.purge_queue("mail") == 0
    assert await r.xlen(keys.stream("mail", 5)) == 0
    assert await r.zcard(keys.retry_schedule("mail")) == 0


async def test_cancel_with_reason_purge_keeps_user_metadata(queue: Queue, r: Redis) -> None:
    meta = {"tags": [], "big": 12345678901234567}
    task = await queue.submit("echo_task", {}, metadata=meta)
    await admin.cancel(queue.store, task.task_id, reason="purge")
    got = await queue.get(task.task_id)
    assert got.metadata == {**meta, "purged": True}


async def test_scripts_refuse_metadata_changed_since_it_was_read(queue: Queue, r: Redis) -> None:
    """Compare-and-set: a script given metadata that is no longer the hash's writes nothing."""
    dead = await queue.submit("echo_task", {}, metadata={"a": 1})
    await dead_letter(r, dead.task_id)
    reply = await calls.dlq_discard(
        queue.store,
        dead.task_id,
        dead.queue,
        '{"a":0}',
        '{"a":0,"discarded":true}',
        "",
        Audit("someone"),
    )
    assert reply == calls.DlqReply(False, "STALE")
    assert await r.xlen(keys.dead_letter("default")) == 1 and await audit_entries(r) == []
    waiting = await queue.submit("echo_task", {}, queue="mail", metadata={"a": 1})
    candidate = calls.PurgeCandidate(waiting.task_id, "", "", "", "{}", "{}")
    reply = await calls.purge_queue(queue.store, "mail", [candidate], None)
    assert reply == calls.QueuePurged(0, {waiting.task_id})
    assert (await queue.get(waiting.task_id)).status is TaskStatus.QUEUED


# -- statistics, workers, audit log -------------------------------------------------------------


async def write_worker(
    r: Redis, worker_id: str, *, queues: str, age_ms: int, status: str = "ready"
) -> None:
    now = await redis_ms(r)
    await r.sadd(keys.WORKERS, worker_id)
    await r.hset(
        keys.worker(worker_id),
        mapping={
            "worker_id": worker_id,
            "hostname": "box",
            "pid": 4242,
            "queues": queues,
            "started_at": format_ts(now - 60_000),
            "last_heartbeat": format_ts(now - age_ms),
            "last_heartbeat_ms": now - age_ms,
            "active_tasks": 1,
            "concurrency": 4,
            "tasks_processed": 10,
            "tasks_failed": 2,
            "tasks_retried": 1,
            "status": status,
        },
    )
    await r.expire(keys.worker(worker_id), 60)


async def test_queue_stats_after_a_known_workload(queue: Queue, r: Redis) -> None:
    for p in (9, 9, 5, 0, 0):
        await queue.submit("echo_task", {}, queue="mail", priority=p)
    h9 = await r.xreadgroup(keys.CONSUMER_GROUP, "c1", {keys.stream("mail", 9): ">"}, count=2)
    assert len(h9[0][1]) == 2
    for _ in range(3):
        await queue.submit("echo_task", {}, queue="mail", delay_seconds=600)
    await queue.submit("echo_task", {}, queue="other", delay_seconds=600)
    dead = await queue.submit("echo_task", {}, queue="other")
    await dead_letter(r, dead.task_id)
    await queue.pause_queue("mail")
    # interval 5 s (default): stale past 15 s.
    await write_worker(r, "worker-aaaaaaaa", queues='["mail","other"]', age_ms=1_000)
    await write_worker(r, "worker-bbbbbbbb", queues="mail", age_ms=20_000)
    await write_worker(r, "worker-cccccccc", queues="other", age_ms=1_000)

    stats = await queue.queue_stats("mail")
    assert stats.model_dump() == {
        "queue": "mail",
        "depth": 5,
        "pending": 2,
        "waiting": 3,
        "paused": True,
        "retry_scheduled": 3,
        "dlq_depth": 1,
        "workers_active": 1,
    }
    by_name = {s.queue: s for s in await queue.all_queue_stats()}
    assert sorted(by_name) == ["mail", "other"]
    assert by_name["other"].depth == 0 and by_name["other"].retry_scheduled == 1
    assert by_name["other"].workers_active == 2 and by_name["other"].paused is False
    never = await queue.queue_stats("never-used")
    assert never.depth == never.pending == never.retry_scheduled == never.workers_active == 0
    with pytest.raises(InvalidTaskError):
        await queue.queue_stats("BAD")


async def test_workers_alive_and_stale(queue: Queue, r: Redis) -> None:
    await write_worker(r, "worker-aaaaaaaa", queues="default,mail", age_ms=500)
    await write_worker(r, "worker-bbbbbbbb", queues="default", age_ms=16_000)
    await write_worker(r, "worker-dddddddd", queues="default", age_ms=0, status="stopped")
    await r.sadd(keys.WORKERS, "worker-eeeeeeee")  # its hash expired: not listed
    found = {w.worker_id: w for w in await queue.workers()}
    assert sorted(found) == ["worker-aaaaaaaa", "worker-bbbbbbbb", "worker-dddddddd"]
    alive = found["worker-aaaaaaaa"]
    assert alive.alive and not alive.stale and alive.queues == ["default", "mail"]
    assert alive.hostname == "box" and alive.pid == 4242 and alive.concurrency == 4
    assert alive.tasks_processed == 10 and alive.tasks_failed == 2 and alive.tasks_retried == 1
    assert alive.heartbeat_age_s is not None and 0.4 <= alive.heartbeat_age_s < 5
    assert alive.last_heartbeat is not None and alive.started_at is not None
    stale = found["worker-bbbbbbbb"]
    assert stale.stale and not stale.alive and stale.status == "ready"
    assert not found["worker-dddddddd"].alive and not found["worker-dddddddd"].stale
    one = await queue.worker("worker-aaaaaaaa")
    assert one.worker_id == "worker-aaaaaaaa" and one.alive
    with pytest.raises(WorkerNotFoundError) as info:
        await queue.worker("worker-eeeeeeee")
    assert info.value.code == "WORKER_NOT_FOUND"


async def test_audit_log_newest_first(queue: Queue, r: Redis) -> None:
    await queue.pause_queue("a", audit=Audit("u1"))
    await queue.resume_queue("a", audit=Audit("u2", "rid"))
    task = await queue.submit("echo_task", {})
    await queue.cancel(task.task_id, audit=Audit("u3"))
    log = await queue.audit_log()
    assert [(e.actor, e.action) for e in log] == [
        ("u3", "cancel"),
        ("u2", "queue_resume"),
        ("u1", "queue_pause"),
    ]
    assert log[0].task_id == task.task_id and log[0].queue == "default"
    assert log[1].task_id is None and log[1].request_id == "rid" and log[1].queue == "a"
    assert log[0].ts >= log[1].ts >= log[2].ts
    assert [e.action for e in await queue.audit_log(limit=1)] == ["cancel"]


# -- the sync facade ----------------------------------------------------------------------------


def test_sync_facade_admin_methods(settings: Settings) -> None:
    with connect_sync(settings=settings) as q:
        task = q.submit("echo_task", {}, queue="mail")
        assert q.pause_queue("mail", audit=OPERATOR) is True
        assert q.queue_stats("mail").depth == 1
        assert [s.queue for s in q.all_queue_stats()] == ["mail"]
        assert q.resume_queue("mail") is True
        assert q.purge_queue("mail") == 1
        assert q.cancel(q.submit("echo_task", {}).task_id).status is TaskStatus.CANCELLED
        assert q.mark_expired(q.submit("echo_task", {}).task_id).status is TaskStatus.EXPIRED
        assert q.dlq_list() == [] and q.purge_dead_letters() == 0
        with pytest.raises(NotInDeadLetterError):
            q.dlq_get(task.task_id)
        with pytest.raises(NotInDeadLetterError):
            q.requeue_dead_letter(task.task_id)
        with pytest.raises(NotInDeadLetterError):
            q.discard_dead_letter(task.task_id)
        assert q.workers() == []
        with pytest.raises(WorkerNotFoundError):
            q.worker("worker-00000000")
        assert [e.action for e in q.audit_log()] == ["queue_pause"]
