"""The atomic submit against a real Redis (DESIGN 3, contract sections 2, 5, 7, 8).

Every assertion reads what Redis holds (hash, stream entry, schedule score, index, record) or
what the SDK user sees (the task, the typed error).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import Queue, calls, connect, keys
from dtq.config import Settings
from dtq.errors import (
    IdempotencyInProgressError,
    InvalidTaskError,
    PayloadTooLargeError,
    QueueFullError,
    UnknownTaskTypeError,
)
from dtq.models import Task, TaskStatus, compact_json, parse_ts
from dtq.store import RECENT_CAP, SUBMIT_CHUNK
from support import Events
from support.worker import ENTRY_FIELDS

pytestmark = pytest.mark.backends("single", "cluster")

EVENT_FIELDS = {"event_id", "ts", "type", "task_id", "queue", "task_type", "attempt", "worker_id"}

QueueFactory = Callable[..., Awaitable[Queue]]


@pytest.fixture
async def make_queue(settings: Settings) -> AsyncIterator[QueueFactory]:
    """Connect SDK queues with settings overrides; all are closed at the end of the test."""
    opened: list[Queue] = []

    async def make(known_types: Any = None, **overrides: Any) -> Queue:
        q = await connect(
            settings=Settings(**{**settings.model_dump(), **overrides}), known_types=known_types
        )
        opened.append(q)
        return q

    yield make
    for q in opened:
        await q.close()


async def task_ids_in_redis(r: Redis) -> set[str]:
    """Task ids of every task hash in Redis (SCAN of every primary, histories left out)."""
    found = set()
    async for key in r.scan_iter(match=keys.task_match(), count=1000):
        task_id = keys.task_id_of(key)
        if key == keys.task(task_id):
            found.add(task_id)
    return found


async def depth(r: Redis, queue: str) -> int:
    pipe = r.pipeline(transaction=False)
    for key in keys.queue_streams(queue):
        pipe.xlen(key)
    return sum(await pipe.execute())


async def redis_ms(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


# -- a queued task -----------------------------------------------------------------------------


async def test_queued_task_entry_hash_and_group(queue: Queue, r: Redis) -> None:
    before = await redis_ms(r)
    task = await queue.submit(
        "echo_task", {"msg": "héllo"}, priority=7, max_attempts=3, timeout_ms=1500
    )
    after = await redis_ms(r)
    assert task.status is TaskStatus.QUEUED and not task.duplicate
    assert len(task.task_id) == 32 and int(task.task_id, 16) >= 0  # uuid4 hex
    assert task.attempt == 0 and task.entry_id

    stream = keys.stream("default", 7)
    entries = await r.xrange(stream)
    assert len(entries) == 1
    entry_id, fields = entries[0]
    assert entry_id == task.entry_id
    assert set(fields) == ENTRY_FIELDS
    assert fields == {
        "task_id": task.task_id,
        "queue": "default",
        "task_type": "echo_task",
        "payload": compact_json({"msg": "héllo"}),
        "attempt": "1",  # the attempt it will execute (DESIGN 4)
        "max_attempts": "3",
        "priority": "7",
        "timeout_ms": "1500",
        "idempotency_key": "",
    }

    h = await r.hgetall(keys.task(task.task_id))
    assert h["status"] == "queued" and h["entry_id"] == entry_id and h["attempt"] == "0"
    assert before <= int(h["created_ms"]) <= after
    assert h["available_at"] == h["created_at"]
    assert await r.ttl(keys.task(task.task_id)) == -1  # no TTL while it waits (DESIGN 11)

    # The group exists on the stream, and on all ten streams of the queue.
    for key in keys.queue_streams("default"):
        groups = await r.xinfo_groups(key)
        assert [g["name"] for g in groups] == [keys.CONSUMER_GROUP], key
    assert await r.smembers(keys.QUEUES) == {"default"}
    # created ms, with the microsecond of the submit as its fraction (order within a ms)
    score = await r.zscore(keys.recent("default"), task.task_id)
    assert score is not None and int(score) == int(h["created_ms"])


async def test_default_timeout_from_settings(make_queue: QueueFactory, r: Redis) -> None:
    q = await make_queue(task_timeout_ms=1234)
    task = await q.submit("echo_task")
    assert task.timeout_ms == 1234
    assert (await r.xrange(keys.stream("default", 5)))[0][1]["timeout_ms"] == "1234"


async def test_each_priority_has_its_own_stream(queue: Queue, r: Redis) -> None:
    tasks = {
        p: await queue.submit("echo_task", {"p": p}, priority=p, queue="prio") for p in range(10)
    }
    for p, task in tasks.items():
        entries = await r.xrange(keys.stream("prio", p))
        assert [e[1]["task_id"] for e in entries] == [task.task_id]
        assert entries[0][1]["priority"] == str(p)
        assert set(entries[0][1]) == ENTRY_FIELDS
    assert await depth(r, "prio") == 10
    assert await depth(r, "default") == 0


# -- a delayed task ------------------------------------------------------------------------


async def test_delayed_task_waits_in_schedule(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {}, delay_seconds=30, priority=2)
    assert task.status is TaskStatus.PENDING and task.entry_id is None
    h = await r.hgetall(keys.task(task.task_id))
    created_ms = int(h["created_ms"])
    assert h["status"] == "pending" and not h.get("entry_id")
    assert await r.zscore(keys.retry_schedule("default"), task.task_id) == created_ms + 30_000
    assert await depth(r, "default") == 0
    got = await queue.get(task.task_id)
    assert got.available_at - got.created_at == timedelta(seconds=30)
    assert got.available_at == task.available_at


async def test_a_task_due_after_its_retention_keeps_its_keys_until_then(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """Retention is never a deadline for waiting work (DESIGN 11): scheduled 30 days out with 7
    days of retention, its hash (payload included) and history have no TTL at all."""
    days = 86_400
    task = await queue.submit("echo_task", {"x": 1}, delay_seconds=30 * days)
    assert 30 * days > settings.task_retention_s
    for key in (keys.task(task.task_id), keys.history(task.task_id)):
        assert await r.ttl(key) == -1, key


async def test_schedule_at_is_the_score(queue: Queue, r: Redis) -> None:
    when = datetime.fromtimestamp((await redis_ms(r) + 60_000) // 1000, tz=UTC)
    task = await queue.submit("echo_task", schedule_at=when)
    assert task.status is TaskStatus.PENDING
    schedule = keys.retry_schedule("default")
    assert await r.zscore(schedule, task.task_id) == int(when.timestamp() * 1000)
    assert (await queue.get(task.task_id)).available_at == when
    assert await depth(r, "default") == 0


# -- errors: each leaves Redis untouched ---------------------------------------------------------


async def test_queue_full(make_queue: QueueFactory, r: Redis) -> None:
    q = await make_queue(max_queue_depth=3)
    for p in (1, 5, 9):  # depth is the sum over the priority streams
        await q.submit("echo_task", priority=p)
    with pytest.raises(QueueFullError) as exc:
        await q.submit("echo_task", priority=0)
    assert exc.value.code == "QUEUE_FULL"
    assert exc.value.retry_after_s >= 1
    assert exc.value.details["depth"] == 3 and exc.value.details["queue"] == "default"
    with pytest.raises(QueueFullError):  # delayed tasks are admitted by the same rule
        await q.submit("echo_task", delay_seconds=5)
    assert len(await task_ids_in_redis(r)) == 3
    assert await depth(r, "default") == 3
    assert await r.zcard(keys.retry_schedule("default")) == 0
    # Another queue has its own depth.
    assert (await q.submit("echo_task", queue="other")).status is TaskStatus.QUEUED


async def test_payload_too_large(make_queue: QueueFactory, r: Redis) -> None:
    q = await make_queue(max_payload_bytes=100)
    exact = {"d": "€" * 30 + "a" * 2}  # 8 + 92 bytes
    assert len(compact_json(exact).encode()) == 100
    await q.submit("echo_task", exact)
    with pytest.raises(PayloadTooLargeError) as exc:
        await q.submit("echo_task", {"d": exact["d"] + "a"})
    assert exc.value.code == "PAYLOAD_TOO_LARGE"
    assert len(await task_ids_in_redis(r)) == 1


@pytest.mark.parametrize(
    "options",
    [
        {"queue": "Bad Queue"},
        {"queue": "q\n"},
        {"priority": 10},
        {"max_attempts": 11},
        {"timeout_ms": 3_600_001},
        {"delay_seconds": -1},
        {"ttl_seconds": 5, "metadata": {"ttl_seconds": 5}},
        {"ttl": timedelta(seconds=1), "expires_at": datetime(2030, 1, 1, tzinfo=UTC)},
        {"expires_at": "2030-01-01T00:00:00"},
        {"metadata": {"m": "x" * 4100}},
        {"idempotency_key": ""},
    ],
)
async def test_invalid_task(queue: Queue, r: Redis, options: dict[str, Any]) -> None:
    with pytest.raises(InvalidTaskError) as exc:
        await queue.submit("echo_task", {}, **options)
    assert exc.value.code == "INVALID_TASK"
    assert await r.dbsize() == 0


@pytest.mark.parametrize("body", [[1, 2], [["a", 1]], "text", 7])
async def test_payload_not_an_object(queue: Queue, r: Redis, body: Any) -> None:
    with pytest.raises(InvalidTaskError, match="payload"):
        await queue.submit("echo_task", body)
    with pytest.raises(InvalidTaskError, match="metadata"):
        await queue.submit("echo_task", {}, metadata=body)
    assert await r.dbsize() == 0


async def test_unknown_task_type(make_queue: QueueFactory, r: Redis) -> None:
    q = await make_queue(known_types={"echo_task"})
    with pytest.raises(UnknownTaskTypeError) as exc:
        await q.submit("rm_rf_task", {})
    assert exc.value.code == "UNKNOWN_TASK_TYPE" and "rm_rf_task" in exc.value.message
    assert await r.dbsize() == 0
    assert (await q.submit("echo_task")).status is TaskStatus.QUEUED


# -- idempotency (contract section 5) -----------------------------------------------------------


async def test_idempotency_lifecycle(queue: Queue, r: Redis) -> None:
    first = await queue.submit("echo_task", {"n": 1}, idempotency_key="order-42", queue="orders")
    record_key = keys.idempotency("orders", "order-42")
    record = json.loads(await r.get(record_key))
    assert record["task_id"] == first.task_id and record["state"] == "processing"
    assert record["updated_at"]
    assert await r.ttl(record_key) == -1  # lives while its task waits or runs (DESIGN 11)
    h = await r.hgetall(keys.task(first.task_id))
    assert h["idempotency_key"] == "order-42"
    entry = (await r.xrange(keys.stream("orders", 5)))[0][1]
    assert entry["idempotency_key"] == "order-42"

    # While the task is not terminal: refused as in progress, nothing new.
    with pytest.raises(IdempotencyInProgressError) as exc:
        await queue.submit("echo_task", {"n": 2}, idempotency_key="order-42", queue="orders")
    assert exc.value.code == "IDEMPOTENCY_IN_PROGRESS"
    assert exc.value.details["task_id"] == first.task_id
    assert await task_ids_in_redis(r) == {first.task_id}

    # Terminal (cancel sets the record to failed): the replay is the stored task, a duplicate.
    await queue.cancel(first.task_id)
    assert json.loads(await r.get(record_key))["state"] == "failed"
    assert 0 < await r.ttl(record_key) <= 86_400  # DTQ_IDEM_TTL_S from the task's end
    replay = await queue.submit("echo_task", {"n": 3}, idempotency_key="order-42", queue="orders")
    assert replay.duplicate is True
    assert replay.task_id == first.task_id
    assert replay.status is TaskStatus.CANCELLED
    assert replay.payload == {"n": 1}  # the stored task, not the replayed body
    assert await task_ids_in_redis(r) == {first.task_id}
    assert await depth(r, "orders") == 0

    # The same key on another queue is another task.
    other = await queue.submit("echo_task", {"n": 4}, idempotency_key="order-42", queue="refunds")
    assert other.task_id != first.task_id and not other.duplicate
    assert await task_ids_in_redis(r) == {first.task_id, other.task_id}


async def test_idempotency_completed_record(queue: Queue, r: Redis) -> None:
    first = await queue.submit("echo_task", idempotency_key="k1")
    # A worker records "completed" when the task succeeds; write that state as it would.
    record_key = keys.idempotency("default", "k1")
    await r.set(
        record_key,
        json.dumps({"task_id": first.task_id, "state": "completed", "updated_at": "x"}),
        ex=100,
    )
    replay = await queue.submit("echo_task", idempotency_key="k1")
    assert replay.duplicate and replay.task_id == first.task_id
    assert len(await task_ids_in_redis(r)) == 1


async def test_100_concurrent_submits_one_key(queue: Queue, r: Redis) -> None:
    results = await asyncio.gather(
        *(queue.submit("echo_task", {"i": i}, idempotency_key="same") for i in range(100)),
        return_exceptions=True,
    )
    created = [x for x in results if isinstance(x, Task)]
    refused = [x for x in results if isinstance(x, IdempotencyInProgressError)]
    assert len(created) == 1 and len(refused) == 99
    assert not created[0].duplicate
    assert await task_ids_in_redis(r) == {created[0].task_id}
    assert {e.details["task_id"] for e in refused} == {created[0].task_id}
    assert await depth(r, "default") == 1


async def test_concurrent_submitters_never_pass_max_depth(
    make_queue: QueueFactory, r: Redis
) -> None:
    q = await make_queue(max_queue_depth=100)
    prefill = await q.submit_many(
        [{"task_type": "echo_task", "priority": i % 10} for i in range(90)]
    )
    assert all(isinstance(t, Task) for t in prefill)
    submitters = [await make_queue(max_queue_depth=100) for _ in range(5)]  # several connections
    results = await asyncio.gather(
        *(submitters[i % 5].submit("echo_task", {"i": i}, priority=i % 10) for i in range(50)),
        return_exceptions=True,
    )
    accepted = [x for x in results if isinstance(x, Task)]
    full = [x for x in results if isinstance(x, QueueFullError)]
    assert len(accepted) == 10 and len(full) == 40
    assert await depth(r, "default") == 100
    assert len(await task_ids_in_redis(r)) == 100


async def test_admission_is_exact_within_and_across_batches(
    make_queue: QueueFactory, r: Redis
) -> None:
    """One submit.lua call reads a queue's depth once and counts its own entries: a batch never
    passes the limit, whatever mix of queues, priorities and delays it holds."""
    q = await make_queue(max_queue_depth=40)
    n = 2 * SUBMIT_CHUNK + 10  # three script calls
    items: list[dict[str, Any]] = []
    for i in range(n):
        item: dict[str, Any] = {"task_type": "echo_task", "payload": {"i": i}, "priority": i % 10}
        if i % 7 == 3:
            item["delay_seconds"] = 60  # admitted by the same rule, adds no entry
        if i % 11 == 5:
            item["queue"] = "side"  # its own depth
        items.append(item)
    results = await q.submit_many(items)
    depth_seen = 0
    for item, result in zip(items, results, strict=True):
        if item.get("queue") == "side":
            assert isinstance(result, Task) and result.queue == "side"
            continue
        if depth_seen >= 40:
            assert isinstance(result, QueueFullError), item
            assert result.details["depth"] == 40
            continue
        assert isinstance(result, Task), item
        if "delay_seconds" not in item:
            depth_seen += 1
    assert await depth(r, "default") == 40
    side = [i for i in items if i.get("queue") == "side" and "delay_seconds" not in i]
    assert await depth(r, "side") == len(side)


async def test_a_batch_creates_the_groups_of_a_new_queue(queue: Queue, r: Redis) -> None:
    results = await queue.submit_many(
        [{"task_type": "echo_task", "queue": "fresh", "priority": p} for p in (0, 9, 5, 9)]
    )
    assert all(isinstance(t, Task) and t.status is TaskStatus.QUEUED for t in results)
    for key in keys.queue_streams("fresh"):
        groups = await r.xinfo_groups(key)
        assert [g["name"] for g in groups] == [keys.CONSUMER_GROUP], key
    assert [await r.xlen(keys.stream("fresh", p)) for p in (9, 5, 0)] == [2, 1, 1]
    assert await r.smembers(keys.QUEUES) == {"fresh"}


async def test_a_redis_error_in_one_task_of_a_batch(queue: Queue, r: Redis) -> None:
    """A key of the wrong type fails that task alone; the others of the call are submitted,
    as separate calls would be, and the SDK raises the Redis error."""
    reqs = [queue.build_request("echo_task", {"i": i}) for i in range(3)]
    ids = [calls.new_task_id("default") for _ in range(3)]  # the queue's slot on a cluster
    await r.set(keys.task(ids[1]), "not a hash")
    [call] = calls.submit_calls(reqs, ids, queue.settings)
    replies = await queue.scripts.call(r, *call)
    assert [x[0] for x in replies] == ["new", "err", "new"]
    assert replies[1][1] == "REDIS" and "WRONGTYPE" in replies[1][2]
    assert (await queue.get(ids[0])).payload == {"i": 0}
    assert (await queue.get(ids[2])).payload == {"i": 2}
    # Through the SDK: the task id is the id the store draws (dtq.calls draws the event ids).
    forced = calls.new_task_id("default")
    await r.set(keys.task(forced), "not a hash")
    drawn = iter([forced])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dtq.store.new_task_id", lambda queue: next(drawn))
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await queue.submit("echo_task", {})


# -- indexes, events, history, expiration ------------------------------------------------------


async def test_recent_index_trimmed(make_queue: QueueFactory, r: Redis) -> None:
    q = await make_queue(max_queue_depth=20_000)
    batches = []
    for b in range(11):
        size = 1_000 if b < 10 else 50
        batch = await q.submit_many([{"task_type": "echo_task"}] * size)
        assert all(isinstance(t, Task) for t in batch)
        batches.append([t.task_id for t in batch if isinstance(t, Task)])
    assert RECENT_CAP == 10_000
    assert await r.zcard(keys.recent("default")) == 10_000
    kept = set(await r.zrange(keys.recent("default"), 0, -1))
    # What the trim removed is the oldest: 50 tasks of the first batch, none of the later ones.
    assert all(tid in kept for batch in batches[1:] for tid in batch)
    assert len(set(batches[0]) - kept) == 50


async def test_task_queued_event(queue: Queue, r: Redis) -> None:
    async with Events(r) as events:
        task = await queue.submit("echo_task", {"a": 1}, queue="events", priority=3)
        await events.wait_for("TASK_QUEUED", task.task_id)
        [event] = events.raw
        assert set(event) == EVENT_FIELDS  # no metadata for a task queued at once
        assert event["type"] == "TASK_QUEUED"
        assert event["task_id"] == task.task_id
        assert (event["queue"], event["task_type"]) == ("events", "echo_task")
        assert event["attempt"] == 0 and event["worker_id"] is None
        assert len(event["event_id"]) == 32
        assert parse_ts(event["ts"]) == task.created_at

        delayed = await queue.submit("echo_task", delay_seconds=10)
        await events.wait_for("TASK_QUEUED", delayed.task_id)
        event2 = events.raw[1]
        assert set(event2) == EVENT_FIELDS | {"metadata"}
        assert event2["type"] == "TASK_QUEUED" and event2["task_id"] == delayed.task_id
        assert event2["metadata"]["status"] == "pending"
        assert event2["metadata"]["available_at"] == (
            delayed.available_at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        )
        assert event2["event_id"] != event["event_id"]


async def test_history_entry(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", delay_seconds=5)
    history = await queue.history(task.task_id)
    assert len(history) == 1
    entry = history[0]
    assert entry.from_status is None and entry.to_status is TaskStatus.PENDING
    assert entry.attempt == 0 and entry.reason == "created" and entry.ts == task.created_at
    # no TTL while the task waits (DESIGN 11)
    assert await r.ttl(keys.history(task.task_id)) == -1


async def test_expiration_fields(queue: Queue, r: Redis) -> None:
    by_ttl = await queue.submit("echo_task", ttl_seconds=60)
    got = await queue.get(by_ttl.task_id)
    assert got.expires_at == got.created_at + timedelta(seconds=60)
    assert got.expires_at == by_ttl.expires_at and got.expired_at is None
    assert await r.zscore(keys.expiry("default"), got.task_id) == int(
        got.expires_at.timestamp() * 1000
    )

    by_delta = await queue.get((await queue.submit("echo_task", ttl=timedelta(minutes=2))).task_id)
    assert by_delta.expires_at == by_delta.created_at + timedelta(minutes=2)

    by_meta = await queue.get(
        (await queue.submit("echo_task", metadata={"ttl_seconds": 1.5})).task_id
    )
    assert by_meta.expires_at == by_meta.created_at + timedelta(seconds=1.5)
    assert by_meta.metadata == {"ttl_seconds": 1.5}

    when = datetime(2031, 6, 1, 12, tzinfo=UTC)
    absolute = await queue.get((await queue.submit("echo_task", expires_at=when)).task_id)
    assert absolute.expires_at == when
    h = await r.hgetall(keys.task(absolute.task_id))
    assert h["expires_at"] == "2031-06-01T12:00:00.000Z"
    assert h["expires_at_ms"] == str(int(when.timestamp() * 1000))

    plain = await queue.get((await queue.submit("echo_task")).task_id)
    assert plain.expires_at is None
    assert await r.zscore(keys.expiry("default"), plain.task_id) is None


async def test_ttl_zero_is_expired_at_submit(queue: Queue, r: Redis) -> None:
    async with Events(r) as events:
        task = await queue.submit("echo_task", ttl_seconds=0, idempotency_key="late")
        assert task.status is TaskStatus.EXPIRED
        await events.wait_for("TASK_EXPIRED", task.task_id)
        event = events.raw[0]
        assert event["type"] == "TASK_EXPIRED" and event["task_id"] == task.task_id
    got = await queue.get(task.task_id)
    assert got.status is TaskStatus.EXPIRED and got.expired_at == got.created_at
    assert await depth(r, "default") == 0
    assert await r.zcard(keys.expiry("default")) == 0
    assert await r.zcard(keys.retry_schedule("default")) == 0
    record = json.loads(await r.get(keys.idempotency("default", "late")))
    assert record["state"] == "failed"
    replay = await queue.submit("echo_task", ttl_seconds=0, idempotency_key="late")
    assert replay.duplicate and replay.task_id == task.task_id
    assert [(e.from_status, e.to_status) for e in await queue.history(task.task_id)] == [
        (None, TaskStatus.QUEUED),
        (TaskStatus.QUEUED, TaskStatus.EXPIRED),
    ]
