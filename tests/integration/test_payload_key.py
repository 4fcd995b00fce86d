"""The payload's own key ``dtq:task:<id>:payload`` (docs/redis-schema.md, "The payload key").

A payload over 64 bytes in the task hash would push the whole hash out of Redis's compact
encoding, so submit writes it beside the hash with the hash's TTL, and every script that refreshes
the hash's TTL refreshes the payload's. A task written before this layout (payload in the hash,
no payload key) must still read, run, dead-letter and requeue with its payload: an upgrade with
tasks in flight loses nothing. Every assertion reads Redis or what the SDK returns.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from test_worker_support import (
    fast,
    finish_as,
    handlers,
    read_as,
    running_worker,
    start_as,
    wait_status,
)

from dtq import Queue, TaskStatus, keys
from dtq.calls import Outcome
from dtq.config import Settings
from dtq.models import Task, compact_json
from dtq.worker.scheduler import Scheduler
from dtq_tasks import TaskContext

PAYLOAD = {"user": "u-123456", "text": "x" * 71}  # 100 bytes of compact JSON
AGED_S = 100  # a TTL far below the retention: a refresh shows as a TTL above it


def test_the_payload_is_over_the_compact_hash_limit() -> None:
    assert len(compact_json(PAYLOAD).encode()) == 100


async def hash_encoding(r: Redis, task_id: str) -> str:
    return str(await r.object("encoding", keys.task(task_id)))


async def age(r: Redis, task_id: str) -> None:
    """Bring the hash's and the payload's TTL down, as if the task had waited for days (a legacy
    task has no payload key)."""
    assert await r.expire(keys.task(task_id), AGED_S)
    await r.expire(keys.payload(task_id), AGED_S)


async def assert_kept_together(r: Redis, task_id: str, settings: Settings) -> None:
    """Both TTLs were refreshed to the retention (the payload's is never the shorter)."""
    hash_ttl = await r.ttl(keys.task(task_id))
    payload_ttl = await r.ttl(keys.payload(task_id))
    assert AGED_S < hash_ttl <= settings.task_retention_s
    assert AGED_S < payload_ttl <= settings.task_retention_s
    assert await r.get(keys.payload(task_id)) == compact_json(PAYLOAD)
    assert "payload" not in await r.hgetall(keys.task(task_id))


async def to_legacy(r: Redis, task_id: str) -> None:
    """Rewrite a task as dtq wrote it before the payload key: the payload a hash field."""
    raw = await r.get(keys.payload(task_id))
    assert raw is not None
    await r.hset(keys.task(task_id), "payload", raw)
    await r.delete(keys.payload(task_id))


def permanent_error() -> Outcome:
    return Outcome("error", duration_ms=3, error_class="PermanentError", error_message="bad")


async def dead_letter(r: Redis, queue: Queue, settings: Settings, task_id: str) -> None:
    """Run the task's start and finish scripts as a worker whose handler failed permanently."""
    task = await queue.get(task_id)
    entry = await read_as(r, "worker-0000dead", task.queue, task.priority)
    started = await start_as(r, entry, "worker-0000dead", settings)
    assert started.kind == "run"
    failed = permanent_error()
    done = await finish_as(r, entry, started.attempt, failed, "worker-0000dead", settings)
    assert done.status == "dead_lettered"


async def dlq_payload(r: Redis, task_id: str) -> Any:
    [fields] = [f for _, f in await r.xrange(keys.DEAD_LETTER) if f["task_id"] == task_id]
    return json.loads(fields["payload"])


async def stream_payload(r: Redis, task: Task) -> Any:
    [(_, fields)] = await r.xrange(keys.stream(task.queue, task.priority))
    return json.loads(fields["payload"])


# -- the layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"delay_seconds": 30}, {"ttl_seconds": 0}],
    ids=["queued", "delayed", "expired-at-submit"],
)
async def test_submit_writes_the_payload_beside_a_compact_hash(
    queue: Queue, r: Redis, settings: Settings, options: dict[str, Any]
) -> None:
    task = await queue.submit("echo_task", PAYLOAD, **options)
    h = await r.hgetall(keys.task(task.task_id))
    assert "payload" not in h and h["task_id"] == task.task_id
    assert await hash_encoding(r, task.task_id) in ("ziplist", "listpack")
    assert await r.get(keys.payload(task.task_id)) == compact_json(PAYLOAD)
    # retention counts from when the task is due (30 s after submit for the delayed one)
    wait_s = int(options.get("delay_seconds", 0))
    payload_ttl = await r.ttl(keys.payload(task.task_id))
    assert payload_ttl == await r.ttl(keys.task(task.task_id))
    assert (
        settings.task_retention_s + wait_s - 5 < payload_ttl <= settings.task_retention_s + wait_s
    )
    assert (await queue.get(task.task_id)).payload == PAYLOAD
    assert task.payload == PAYLOAD
    if task.status is TaskStatus.QUEUED:
        assert await stream_payload(r, task) == PAYLOAD  # the entry keeps it (contract 2)


async def test_reads_and_replays_return_the_payload(queue: Queue, r: Redis) -> None:
    first = await queue.submit("echo_task", PAYLOAD, idempotency_key="k-payload")
    await queue.submit("echo_task", {"other": 1})
    listed = {t.task_id: t.payload for t in await queue.list()}
    assert listed[first.task_id] == PAYLOAD
    # A replay answers with the stored task, payload included, in one batch or alone.
    await r.set(
        keys.idempotency("default", "k-payload"),
        json.dumps({"task_id": first.task_id, "state": "completed", "updated_at": "x"}),
    )
    replay = await queue.submit("echo_task", {"ignored": True}, idempotency_key="k-payload")
    assert replay.duplicate and replay.payload == PAYLOAD
    [batch] = await queue.submit_many(
        [{"task_type": "echo_task", "payload": {}, "idempotency_key": "k-payload"}]
    )
    assert isinstance(batch, Task) and batch.duplicate and batch.payload == PAYLOAD


# -- every TTL refresh refreshes both -----------------------------------------------------------

Op = Callable[[Queue, Redis, Settings, str], Awaitable[None]]


async def op_cancel(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await queue.cancel(task_id)


async def op_mark_expired(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await queue.mark_expired(task_id)


async def op_start(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    entry = await read_as(r, "worker-00000001")
    assert (await start_as(r, entry, "worker-00000001", settings)).kind == "run"


async def op_finish(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    entry = await read_as(r, "worker-00000001")
    started = await start_as(r, entry, "worker-00000001", settings)
    await age(r, task_id)
    success = Outcome("success")
    done = await finish_as(r, entry, started.attempt, success, "worker-00000001", settings)
    assert done.status == "succeeded"


async def op_finish_dead_letter(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await dead_letter(r, queue, settings, task_id)
    assert await dlq_payload(r, task_id) == PAYLOAD


async def op_worker_lost(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    """Started by a worker that died; its redelivery is past max_attempts: dead-lettered."""
    entry = await read_as(r, "worker-deaddead")
    await start_as(r, entry, "worker-deaddead", settings)
    await age(r, task_id)
    await r.xclaim(entry.stream, keys.CONSUMER_GROUP, "worker-00000002", 0, [entry.entry_id])
    assert (await start_as(r, entry, "worker-00000002", settings)).kind == "dead"
    assert await dlq_payload(r, task_id) == PAYLOAD


async def op_dlq_requeue(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await dead_letter(r, queue, settings, task_id)
    await age(r, task_id)
    task = await queue.requeue_dead_letter(task_id)
    assert task.payload == PAYLOAD and await stream_payload(r, task) == PAYLOAD


async def op_dlq_discard(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await dead_letter(r, queue, settings, task_id)
    await age(r, task_id)
    await queue.discard_dead_letter(task_id)


async def op_dlq_purge(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await dead_letter(r, queue, settings, task_id)
    await age(r, task_id)
    assert await queue.purge_dead_letters() == 1


async def op_purge_queue(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    assert await queue.purge_queue("default") == 1


async def op_promote(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await r.zadd(keys.RETRY_SCHEDULE, {task_id: 0})  # due now
    assert (await Scheduler(queue.store, settings, "worker-5c4ed000").tick()).promoted == [task_id]
    assert await stream_payload(r, await queue.get(task_id)) == PAYLOAD


OPS: dict[str, tuple[Op, dict[str, Any]]] = {
    "cancel": (op_cancel, {}),
    "mark_expired": (op_mark_expired, {}),
    "promote": (op_promote, {"delay_seconds": 60}),
    "start": (op_start, {}),
    "finish": (op_finish, {}),
    "finish-dead-letter": (op_finish_dead_letter, {}),
    "start-worker-lost": (op_worker_lost, {"max_attempts": 1}),
    "dlq_requeue": (op_dlq_requeue, {}),
    "dlq_discard": (op_dlq_discard, {}),
    "dlq_purge": (op_dlq_purge, {}),
    "purge_queue": (op_purge_queue, {}),
}


@pytest.mark.parametrize("name", list(OPS))
async def test_every_state_change_keeps_the_payload_with_the_hash(
    queue: Queue, r: Redis, settings: Settings, name: str
) -> None:
    op, options = OPS[name]
    task = await queue.submit("echo_task", PAYLOAD, **options)
    await age(r, task.task_id)
    await op(queue, r, settings, task.task_id)
    await assert_kept_together(r, task.task_id, settings)
    assert (await queue.get(task.task_id)).payload == PAYLOAD


# -- tasks written before the payload key ---------------------------------------------------------


async def test_legacy_task_reads_with_its_payload(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", PAYLOAD, idempotency_key="k-old")
    await to_legacy(r, task.task_id)
    assert not await r.exists(keys.payload(task.task_id))
    assert (await queue.get(task.task_id)).payload == PAYLOAD
    assert [t.payload for t in await queue.list()] == [PAYLOAD]
    await r.set(
        keys.idempotency("default", "k-old"),
        json.dumps({"task_id": task.task_id, "state": "failed", "updated_at": "x"}),
    )
    replay = await queue.submit("echo_task", {}, idempotency_key="k-old")
    assert replay.duplicate and replay.payload == PAYLOAD


@pytest.mark.parametrize("name", ["promote", "finish-dead-letter", "start-worker-lost"])
async def test_legacy_task_moves_with_its_payload(
    queue: Queue, r: Redis, settings: Settings, name: str
) -> None:
    """Promotion and both dead-letter paths take a legacy task's payload from its hash."""
    op, options = OPS[name]
    task = await queue.submit("echo_task", PAYLOAD, **options)
    await to_legacy(r, task.task_id)
    await op(queue, r, settings, task.task_id)
    assert (await queue.get(task.task_id)).payload == PAYLOAD
    assert not await r.exists(keys.payload(task.task_id))  # nothing recreates the key


async def test_legacy_dead_letter_requeues_and_runs_with_its_payload(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    seen: list[dict[str, Any]] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> str:
        seen.append(payload)
        return "ok"

    task = await queue.submit("wt_record", PAYLOAD)
    await to_legacy(r, task.task_id)
    await dead_letter(r, queue, settings, task.task_id)
    assert (await queue.dlq_get(task.task_id)).payload == PAYLOAD
    requeued = await queue.requeue_dead_letter(task.task_id)
    assert requeued.payload == PAYLOAD and await stream_payload(r, requeued) == PAYLOAD
    async with running_worker(fast(settings), handlers(wt_record=record)):
        await wait_status(r, task.task_id, "succeeded")
    assert seen == [PAYLOAD]
    assert (await queue.get(task.task_id)).payload == PAYLOAD


async def test_legacy_delayed_task_is_promoted_and_runs(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    seen: list[dict[str, Any]] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        seen.append(payload)

    task = await queue.submit("wt_record", PAYLOAD, delay_seconds=60)
    await to_legacy(r, task.task_id)
    await r.zadd(keys.RETRY_SCHEDULE, {task.task_id: 0})  # due now
    async with running_worker(fast(settings), handlers(wt_record=record)):
        await wait_status(r, task.task_id, "succeeded")
    assert seen == [PAYLOAD]


async def test_legacy_task_cancels_and_expires(queue: Queue, r: Redis) -> None:
    """Cancel and mark_expired of a legacy task, whose payload key does not exist."""
    a = await queue.submit("echo_task", PAYLOAD)
    b = await queue.submit("echo_task", PAYLOAD)
    for t in (a, b):
        await to_legacy(r, t.task_id)
    assert (await queue.cancel(a.task_id)).payload == PAYLOAD
    assert (await queue.mark_expired(b.task_id)).payload == PAYLOAD
