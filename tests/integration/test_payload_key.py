"""The payload in the task hash (contract section 2; docs/redis-schema.md, "Task hash fields").

``dtq:task:<id>`` is a hash with all task fields: ``HGET dtq:task:<id> payload`` gives the
payload's compact JSON whatever the task's status, and no ``dtq:task:<id>:payload`` key is
written. A task the dtq before this one wrote keeps its payload in that key and no ``payload``
field (docs/redis-schema.md, "Tasks an older dtq wrote"): it must still read, run, dead-letter
and requeue with its payload, and the first script that gives it a lifetime moves the key into
the hash, so that the payload lives exactly as long as the hash. Every assertion reads Redis or
what the SDK returns.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, TaskStatus, keys
from dtq.calls import Outcome
from dtq.config import Settings
from dtq.models import Task, compact_json
from dtq.worker.scheduler import Scheduler
from dtq_tasks import TaskContext
from support import running_worker
from support.worker import fast, finish_as, handlers, read_as, start_as, wait_status

PAYLOAD = {"user": "u-123456", "text": "x" * 71}  # 100 bytes of compact JSON
AGED_S = 100  # a TTL far below the retention: a retention set anew shows as a TTL above it


def test_the_payload_is_over_the_compact_hash_limit() -> None:
    assert len(compact_json(PAYLOAD).encode()) == 100


async def age(r: Redis, task_id: str) -> None:
    """Bring the hash's TTL down, as if the task had ended days ago."""
    assert await r.expire(keys.task(task_id), AGED_S)


async def old_payload_keys(r: Redis) -> list[str]:
    return [k async for k in r.scan_iter(match="dtq:task:*:payload", count=1000)]


async def assert_payload_in_hash(r: Redis, task_id: str, settings: Settings) -> None:
    """The payload is the hash's field, no payload key exists, and the hash's lifetime is its
    status's: none while the task waits or runs, the retention set anew once it ended."""
    assert await r.hget(keys.task(task_id), "payload") == compact_json(PAYLOAD)
    assert await old_payload_keys(r) == []
    ttl = await r.ttl(keys.task(task_id))
    if await r.hget(keys.task(task_id), "status") in {"pending", "queued", "retrying", "running"}:
        assert ttl == -1
    else:
        assert AGED_S < ttl <= settings.task_retention_s


async def to_old_layout(r: Redis, task_id: str) -> None:
    """Rewrite a task as the dtq before this one wrote it: the payload in a key of its own with
    the hash's TTL (it gave every task the retention), no payload field in the hash."""
    raw = await r.hget(keys.task(task_id), "payload")
    assert raw is not None
    await r.hdel(keys.task(task_id), "payload")
    await r.set(keys.payload(task_id), raw, ex=AGED_S)
    await r.expire(keys.task(task_id), AGED_S)
    await r.expire(keys.history(task_id), AGED_S)


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
async def test_submit_writes_the_payload_into_the_hash(
    queue: Queue, r: Redis, settings: Settings, options: dict[str, Any]
) -> None:
    task = await queue.submit("echo_task", PAYLOAD, **options)
    assert await r.hget(keys.task(task.task_id), "payload") == compact_json(PAYLOAD)
    assert await old_payload_keys(r) == []
    ttl = await r.ttl(keys.task(task.task_id))
    if task.status is TaskStatus.EXPIRED:
        assert settings.task_retention_s - 5 < ttl <= settings.task_retention_s
    else:
        assert ttl == -1  # no TTL while the task waits (DESIGN 11)
    assert (await queue.get(task.task_id)).payload == PAYLOAD
    assert task.payload == PAYLOAD
    if task.status is TaskStatus.QUEUED:
        assert await stream_payload(r, task) == PAYLOAD  # the entry has it too (contract 2)


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


# -- every script keeps the payload in the hash ---------------------------------------------------

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


async def op_finish_retry(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    entry = await read_as(r, "worker-00000001")
    started = await start_as(r, entry, "worker-00000001", settings)
    await age(r, task_id)
    retry = Outcome("error", error_class="RetryableError", retryable=True, delay_ms=60_000)
    done = await finish_as(r, entry, started.attempt, retry, "worker-00000001", settings)
    assert done.status == "retrying"


async def op_finish_failed(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    entry = await read_as(r, "worker-00000001")
    started = await start_as(r, entry, "worker-00000001", settings)
    failed = permanent_error()
    done = await finish_as(r, entry, started.attempt, failed, "worker-00000001", settings)
    assert done.status == "failed"


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


async def op_promote_expired(queue: Queue, r: Redis, settings: Settings, task_id: str) -> None:
    await r.hset(keys.task(task_id), "expires_at_ms", 1)  # its deadline has passed
    await r.zadd(keys.RETRY_SCHEDULE, {task_id: 0})
    await Scheduler(queue.store, settings, "worker-5c4ed000").tick()
    assert await r.hget(keys.task(task_id), "status") == "expired"


# Each reaches the status in its name (or a terminal one) through the script that sets it.
OPS: dict[str, tuple[Op, dict[str, Any], str]] = {
    "cancel": (op_cancel, {}, "cancelled"),
    "mark_expired": (op_mark_expired, {}, "expired"),
    "promote": (op_promote, {"delay_seconds": 60}, "queued"),
    "promote-expired": (op_promote_expired, {"delay_seconds": 60}, "expired"),
    "start": (op_start, {}, "running"),
    "finish": (op_finish, {}, "succeeded"),
    "finish-retry": (op_finish_retry, {"max_attempts": 3}, "retrying"),
    "finish-failed": (op_finish_failed, {}, "failed"),
    "finish-dead-letter": (op_finish_dead_letter, {}, "dead_lettered"),
    "start-worker-lost": (op_worker_lost, {"max_attempts": 1}, "dead_lettered"),
    "dlq_requeue": (op_dlq_requeue, {}, "queued"),
    "dlq_discard": (op_dlq_discard, {}, "dead_lettered"),
    "dlq_purge": (op_dlq_purge, {}, "dead_lettered"),
    "purge_queue": (op_purge_queue, {}, "cancelled"),
}


@pytest.mark.parametrize("name", list(OPS))
async def test_every_state_change_keeps_the_payload_in_the_hash(
    queue: Queue, r: Redis, settings: Settings, name: str
) -> None:
    op, options, status = OPS[name]
    settings = settings.model_copy(update={"dlq_enabled": name != "finish-failed"})
    task = await queue.submit("echo_task", PAYLOAD, **options)
    await op(queue, r, settings, task.task_id)
    assert await r.hget(keys.task(task.task_id), "status") == status
    await assert_payload_in_hash(r, task.task_id, settings)
    assert (await queue.get(task.task_id)).payload == PAYLOAD


def test_the_state_changes_reach_every_status() -> None:
    """With a delayed submit (pending), the cases above see each of the nine statuses."""
    reached = {status for _, _, status in OPS.values()} | {"pending"}
    assert reached == {s.value for s in TaskStatus}


# -- tasks the dtq before this one wrote (payload in its own key) ---------------------------------


async def test_old_task_reads_with_its_payload(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", PAYLOAD, idempotency_key="k-old")
    await to_old_layout(r, task.task_id)
    assert await r.hget(keys.task(task.task_id), "payload") is None
    assert (await queue.get(task.task_id)).payload == PAYLOAD
    assert [t.payload for t in await queue.list()] == [PAYLOAD]
    await r.set(
        keys.idempotency("default", "k-old"),
        json.dumps({"task_id": task.task_id, "state": "failed", "updated_at": "x"}),
    )
    replay = await queue.submit("echo_task", {}, idempotency_key="k-old")
    assert replay.duplicate and replay.payload == PAYLOAD


async def test_a_read_mixes_old_and_new_tasks(queue: Queue, r: Redis) -> None:
    old = await queue.submit("echo_task", PAYLOAD)
    new = await queue.submit("echo_task", {"n": 1})
    await to_old_layout(r, old.task_id)
    got = await queue.store.get_many([new.task_id, "0" * 32, old.task_id])
    assert [(t.task_id, t.payload) for t in got] == [
        (new.task_id, {"n": 1}),
        (old.task_id, PAYLOAD),
    ]


@pytest.mark.parametrize("name", list(OPS))
async def test_old_task_gets_its_payload_moved_into_the_hash(
    queue: Queue, r: Redis, settings: Settings, name: str
) -> None:
    """Whatever script first gives an old task a lifetime moves its payload key into the hash:
    a task that now waits or runs without a TTL never outlives its payload, and the entries the
    scripts write (stream, dead letter) carry it."""
    op, options, status = OPS[name]
    settings = settings.model_copy(update={"dlq_enabled": name != "finish-failed"})
    task = await queue.submit("echo_task", PAYLOAD, **options)
    await to_old_layout(r, task.task_id)
    await op(queue, r, settings, task.task_id)
    assert await r.hget(keys.task(task.task_id), "status") == status
    await assert_payload_in_hash(r, task.task_id, settings)
    assert (await queue.get(task.task_id)).payload == PAYLOAD


@pytest.mark.parametrize("worker_lost", [False, True], ids=["finish", "start-worker-lost"])
async def test_old_running_task_dead_letters_with_its_payload(
    queue: Queue, r: Redis, settings: Settings, worker_lost: bool
) -> None:
    """A task the previous dtq had started when it was upgraded: the dead-letter entry, written
    by finish or by start's WorkerLost path, takes its payload from the old key."""
    task = await queue.submit("echo_task", PAYLOAD, max_attempts=1)
    entry = await read_as(r, "worker-deaddead")
    started = await start_as(r, entry, "worker-deaddead", settings)
    await to_old_layout(r, task.task_id)
    if worker_lost:
        await r.xclaim(entry.stream, keys.CONSUMER_GROUP, "worker-00000002", 0, [entry.entry_id])
        assert (await start_as(r, entry, "worker-00000002", settings)).kind == "dead"
    else:
        failed = permanent_error()
        done = await finish_as(r, entry, started.attempt, failed, "worker-deaddead", settings)
        assert done.status == "dead_lettered"
    assert await dlq_payload(r, task.task_id) == PAYLOAD
    await assert_payload_in_hash(r, task.task_id, settings)


async def test_old_dead_letter_requeues_and_runs_with_its_payload(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    seen: list[dict[str, Any]] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> str:
        seen.append(payload)
        return "ok"

    task = await queue.submit("wt_record", PAYLOAD)
    await dead_letter(r, queue, settings, task.task_id)
    await to_old_layout(r, task.task_id)
    assert (await queue.dlq_get(task.task_id)).payload == PAYLOAD
    requeued = await queue.requeue_dead_letter(task.task_id)
    assert requeued.payload == PAYLOAD and await stream_payload(r, requeued) == PAYLOAD
    async with running_worker(fast(settings), handlers(wt_record=record)):
        await wait_status(r, task.task_id, "succeeded")
    assert seen == [PAYLOAD]
    await assert_payload_in_hash(r, task.task_id, settings)


async def test_old_delayed_task_is_promoted_and_runs(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    seen: list[dict[str, Any]] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        seen.append(payload)

    task = await queue.submit("wt_record", PAYLOAD, delay_seconds=60)
    await to_old_layout(r, task.task_id)
    await r.zadd(keys.RETRY_SCHEDULE, {task.task_id: 0})  # due now
    async with running_worker(fast(settings), handlers(wt_record=record)):
        await wait_status(r, task.task_id, "succeeded")
    assert seen == [PAYLOAD]
    await assert_payload_in_hash(r, task.task_id, settings)
