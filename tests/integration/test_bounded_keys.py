"""No unbounded state (contract section 2): after a mixed workload every key in Redis has a TTL
or is one of the documented bounded keys, and the bounded ones hold only live members.

A task's own keys (hash, history, payload) and its idempotency record have no TTL while the task
waits or runs (DESIGN 11): they are bounded by the live work, each indexed by a stream entry or a
schedule member, and get their TTL when the task ends.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import re
from typing import Any

from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.admin import sweep_due
from dtq.config import Settings
from dtq.errors import IdempotencyInProgressError, QueueFullError
from dtq.models import NOT_STARTED, TaskStatus
from dtq.store import RECENT_CAP
from support import wait_until

# Keys without a TTL, each with the reason it cannot grow without bound.
BOUNDED: dict[str, str] = {
    r"dtq:stream:[a-z0-9][a-z0-9_-]{0,63}:p[0-9]": (
        "task stream: an entry is XDELed when ACKed or removed by cancel/expire, and admission "
        "keeps the sum of XLEN over a queue's streams <= DTQ_MAX_QUEUE_DEPTH"
    ),
    re.escape(keys.DEAD_LETTER): "DLQ stream: XADD MAXLEN ~ DTQ_DLQ_MAXLEN",
    re.escape(keys.AUDIT): "audit stream: XADD MAXLEN ~ 10000",
    re.escape(keys.RETRY_SCHEDULE): (
        "one member per delayed or retrying task, removed at promotion, cancel or expiry"
    ),
    re.escape(keys.RETRY_CLAIMED): "claimed members are removed after XADD; stale ones reaped",
    re.escape(keys.RECENT): f"trimmed to {RECENT_CAP} members at every submit",
    re.escape(keys.EXPIRY): (
        "one member per expiring task not started yet, removed when it starts, ends or expires; "
        "the sweep drops members of gone or finished tasks"
    ),
    re.escape(keys.QUEUES): "one member per queue in use; idle queues are removed",
    r"dtq:queue:[a-z0-9][a-z0-9_-]{0,63}:last_submit": (
        "one per queue in dtq:queues, removed with the queue when it is idle"
    ),
    re.escape(keys.WORKERS): "members removed once their heartbeat hash has expired",
    re.escape(keys.CANCELLED): (
        "members removed when their delivered entry is consumed, or by the leader once the "
        "entry or the hash is gone"
    ),
    r"dtq:queue:[a-z0-9][a-z0-9_-]{0,63}:paused": "one per paused queue, deleted at resume",
    r"dtq:schedules": "one member per schedule, removed when it is deleted",
    r"dtq:schedule:[a-z0-9][a-z0-9_-]{0,63}": "one hash per schedule, deleted with it",
    r"dtq:schedule:[a-z0-9][a-z0-9_-]{0,63}:history": (
        "one list per schedule, LTRIMmed to its last 100 decisions, deleted with it"
    ),
}
BOUNDED_RE = re.compile("|".join(f"(?:{p})" for p in BOUNDED) + r"\Z")
TASK_KEY_RE = re.compile(r"dtq:task:([0-9a-f]{32})(?::history)?\Z")
LIVE = {"pending", "queued", "retrying", "running"}


async def wait_until_redis_ms(r: Redis, target_ms: int, timeout_s: float = 5.0) -> int:
    """Wait until the Redis clock reads ``target_ms``; returns its reading (polled back to
    back: a millisecond matters)."""
    now = 0

    async def reached() -> bool:
        nonlocal now
        sec, usec = await r.time()
        now = int(sec) * 1000 + int(usec) // 1000
        return now >= target_ms

    await wait_until(reached, timeout_s, f"Redis clock at {target_ms}", every_s=0)
    return now


async def mixed_workload(q: Queue, small: Queue, r: Redis) -> None:
    plain = [await q.submit("echo_task", {"p": p}, priority=p, queue="mix") for p in range(10)]
    delayed = await q.submit("echo_task", delay_seconds=120, queue="mix")
    await q.submit("echo_task", delay_seconds=300, ttl_seconds=600)
    expiring = await q.submit("echo_task", ttl_seconds=0.05, queue="mix")
    await q.submit("echo_task", metadata={"ttl_seconds": 3600})
    await q.submit("echo_task", ttl_seconds=0)  # expired at submit
    keyed = await q.submit("echo_task", idempotency_key="k-1")
    with contextlib.suppress(IdempotencyInProgressError):
        await q.submit("echo_task", idempotency_key="k-1")
    await q.cancel(keyed.task_id)
    await q.submit("echo_task", idempotency_key="k-1")  # duplicate replay
    await q.submit("echo_task", idempotency_key="k-1", queue="other")
    await q.cancel(plain[3].task_id)
    await q.cancel(delayed.task_id)
    await q.mark_expired(plain[4].task_id)
    await q.submit_many(
        [
            {"task_type": "echo_task", "priority": i % 10, "idempotency_key": f"b-{i}"}
            for i in range(40)
        ]
    )
    for _ in range(4):
        with contextlib.suppress(QueueFullError):
            await small.submit("echo_task", queue="tiny")
    # A schedule, its manual firing (a task with its own idempotency record) and its history.
    await q.put_schedule("nightly", cron="0 3 * * *", task_type="echo_task", queue="mix")
    await q.trigger_schedule("nightly")
    await q.pause_schedule("nightly")
    # The expiry sweep (the scheduler leader's job) marks the due task and cleans its indexes.
    h = await r.hgetall(keys.task(expiring.task_id))
    now = await wait_until_redis_ms(r, int(h["expires_at_ms"]))
    assert list((await sweep_due(q.store, now, 100)).expired) == [expiring.task_id]


async def test_every_key_has_a_ttl_or_a_bound(settings: Settings, queue: Queue, r: Redis) -> None:
    small = await connect(settings=Settings(**{**settings.model_dump(), "max_queue_depth": 2}))
    try:
        await mixed_workload(queue, small, r)
    finally:
        await small.close()

    # Retention and the idempotency TTL count from a task's end, never more.
    max_ttl_ms = max(settings.task_retention_s, settings.idem_ttl_s) * 1000
    unbounded: list[str] = []
    kinds: dict[str, int] = {}
    async for key in r.scan_iter(count=1000):
        assert not key.endswith(":payload"), key  # the payload is a field of the hash
        pttl = await r.pttl(key)
        task_key = TASK_KEY_RE.match(key)
        status = await status_of(r, task_key.group(1)) if task_key else None
        if pttl > 0:
            assert pttl <= max_ttl_ms, (key, pttl)
            assert status is None or status not in LIVE, (key, status)  # terminal: retained
            kinds["ttl"] = kinds.get("ttl", 0) + 1
            continue
        assert pttl == -1, (key, pttl)
        if task_key:
            assert status in LIVE, (key, status)  # no TTL only while it waits or runs
            kinds["live"] = kinds.get("live", 0) + 1
            continue
        if fnmatch.fnmatchcase(key, keys.idempotency("*", "*")):
            record = json.loads(await r.get(key))
            assert record["state"] == "processing", (key, record)
            assert await status_of(r, record["task_id"]) in LIVE, (key, record)
            continue
        if not BOUNDED_RE.match(key):
            unbounded.append(f"{key} ({await r.type(key)})")
        kinds[key.split(":")[1]] = kinds.get(key.split(":")[1], 0) + 1
    assert not unbounded, f"keys without TTL and without a documented bound: {unbounded}"
    assert not await r.exists(keys.idempotency("default", None))  # the placeholder is never set
    assert kinds["ttl"] > 10 and kinds["live"] > 100  # the workload did write per-task keys
    lock_ttl = await r.pttl(keys.SCHEDULER_LOCK)
    assert lock_ttl == -2 or 0 < lock_ttl <= 10_000  # absent, or SET NX PX 10000


async def status_of(r: Redis, task_id: str) -> str | None:
    value: str | None = await r.hget(keys.task(task_id), "status")
    return value


async def test_bounded_keys_hold_only_live_members(
    settings: Settings, queue: Queue, r: Redis
) -> None:
    small = await connect(settings=Settings(**{**settings.model_dump(), "max_queue_depth": 2}))
    try:
        await mixed_workload(queue, small, r)
    finally:
        await small.close()
    not_started = {s.value for s in NOT_STARTED}

    # Every stream entry is the one live entry of a queued task.
    for queue_name in await queue.store.queues():
        total = 0
        for stream in keys.queue_streams(queue_name):
            for entry_id, fields in await r.xrange(stream):
                h: dict[str, Any] = await r.hgetall(keys.task(fields["task_id"]))
                assert h["status"] == TaskStatus.QUEUED.value, (stream, fields)
                assert h["entry_id"] == entry_id
                assert keys.stream(h["queue"], int(h["priority"])) == stream
                total += 1
        assert total <= (2 if queue_name == "tiny" else settings.max_queue_depth)

    for tid in await r.zrange(keys.RETRY_SCHEDULE, 0, -1):
        assert await status_of(r, tid) in {"pending", "retrying"}, tid
    for tid, score in await r.zrange(keys.EXPIRY, 0, -1, withscores=True):
        assert await status_of(r, tid) in not_started, tid
        assert await r.hget(keys.task(tid), "expires_at_ms") == str(int(score))
    assert await r.scard(keys.CANCELLED) == 0  # nothing was delivered, so nothing waits for ACK
    assert await r.zcard(keys.RECENT) <= RECENT_CAP
    assert await r.smembers(keys.QUEUES) == {"mix", "default", "other", "tiny"}

    # Idempotency records point at their task; the state follows the task's status.
    async for key in r.scan_iter(match=keys.idempotency("*", "*"), count=1000):
        record = json.loads(await r.get(key))
        status = await status_of(r, record["task_id"])
        assert status is not None, key
        expected = "processing" if status in not_started else "failed"
        assert record["state"] == expected, (key, status, record)
