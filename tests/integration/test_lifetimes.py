"""Lifetimes (DESIGN 11, docs/redis-schema.md "Lifetimes"): retention counts from a task's
terminal state and is never a deadline for waiting or running work; an idempotency record lives
as long as its task waits or runs, and only the task it names ever updates it.

The settings shrink the retention and the idempotency TTL to a second or two, and the tests wait
on the Redis clock (the one whose TTLs decide) until those have passed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq.errors import IdempotencyInProgressError
from dtq_tasks import PermanentError, RetryableError, TaskContext
from support import running_worker, wait_until
from support.worker import fast, handlers, wait_status

RETENTION_S = 2
IDEM_TTL_S = 2
# Past every TTL these settings give: the retention, the idempotency TTL, and a margin for the
# second-granular EXPIRE.
OUTLIVE_MS = (max(RETENTION_S, IDEM_TTL_S) + 1) * 1000 + 200


@pytest.fixture
def short(settings: Settings) -> Settings:
    return fast(settings, task_retention_s=RETENTION_S, idem_ttl_s=IDEM_TTL_S)


@pytest.fixture
async def q(short: Settings) -> AsyncIterator[Queue]:
    client = await connect(settings=short)
    yield client
    await client.close()


async def redis_ms(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def wait_redis_clock(r: Redis, target_ms: int) -> None:
    """Wait until the Redis clock has reached ``target_ms`` (10 s deadline)."""

    async def reached() -> bool:
        return await redis_ms(r) >= target_ms

    await wait_until(reached, 10, f"Redis clock at {target_ms}")


def task_keys(task_id: str) -> list[str]:
    return [keys.task(task_id), keys.history(task_id)]


async def assert_no_ttl(r: Redis, task_id: str) -> None:
    for key in task_keys(task_id):
        assert await r.ttl(key) == -1, key  # -2 would be "gone"


async def assert_retained(r: Redis, task_id: str) -> None:
    """A terminal task's keys expire within the retention."""
    for key in task_keys(task_id):
        assert 0 < await r.ttl(key) <= RETENTION_S, key


async def wait_gone(r: Redis, task_id: str) -> None:
    async def gone() -> bool:
        return await r.exists(*task_keys(task_id)) == 0

    await wait_until(gone, RETENTION_S + 5, f"task {task_id} keys expired")


async def echo(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return payload


# -- retention is no deadline for waiting or running work ------------------------------------


@pytest.mark.parametrize(
    "options", [{}, {"delay_seconds": 0.2}], ids=["queued", "delayed-then-queued"]
)
async def test_a_task_waiting_longer_than_the_retention_runs(
    q: Queue, r: Redis, short: Settings, options: dict[str, Any]
) -> None:
    """QUEUED (or PENDING, then QUEUED once due) well past the retention: its hash, history and
    payload are all there when a worker reads it, it runs, and only then does retention start."""
    task = await q.submit("lt_echo", {"n": 1}, **options)
    start = await redis_ms(r)
    if options:
        # the scheduler of a worker on another queue promotes it; nothing serves `default`
        async with running_worker(short, handlers(), queues=("elsewhere",)):
            await wait_status(r, task.task_id, "queued")
    await wait_redis_clock(r, start + OUTLIVE_MS)
    assert (await q.get(task.task_id)).status.value == "queued"
    await assert_no_ttl(r, task.task_id)

    async with running_worker(short, handlers(lt_echo=echo)):
        h = await wait_status(r, task.task_id, "succeeded", "failed", "dead_lettered")
    assert h["status"] == "succeeded"
    assert (await q.get(task.task_id)).payload == {"n": 1}
    history = [e.to_status.value for e in await q.history(task.task_id)]
    assert history[-2:] == ["running", "succeeded"]
    await assert_retained(r, task.task_id)
    await wait_gone(r, task.task_id)  # retention still ends a finished task


async def test_a_task_running_longer_than_the_retention_finishes(
    q: Queue, r: Redis, short: Settings
) -> None:
    """A handler that runs past the retention finishes its task: SUCCEEDED, its history whole."""
    release = asyncio.Event()
    started: list[int] = []

    async def slow(payload: dict[str, Any], ctx: TaskContext) -> str:
        started.append(ctx.attempt)
        await release.wait()
        return "done"

    task = await q.submit("lt_slow", {}, timeout_ms=60_000)
    async with running_worker(short, handlers(lt_slow=slow)):
        await wait_status(r, task.task_id, "running")
        begin = await redis_ms(r)
        await wait_redis_clock(r, begin + OUTLIVE_MS)
        assert await r.hget(keys.task(task.task_id), "status") == "running"
        await assert_no_ttl(r, task.task_id)
        release.set()
        h = await wait_status(r, task.task_id, "succeeded", "failed", "dead_lettered")
    assert h["status"] == "succeeded" and started == [1]
    assert [e.to_status.value for e in await q.history(task.task_id)] == [
        "queued",
        "running",
        "succeeded",
    ]
    await assert_retained(r, task.task_id)


async def test_a_retry_waiting_longer_than_the_retention_runs(
    q: Queue, r: Redis, short: Settings
) -> None:
    """RETRYING for longer than the retention (a long backoff), then promoted and run."""
    calls: list[int] = []

    async def once_then_ok(payload: dict[str, Any], ctx: TaskContext) -> int:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RetryableError("first attempt fails")
        return ctx.attempt

    task = await q.submit("lt_retry", {}, max_attempts=2)
    backoff = fast(short, retry_base_delay=3.5, retry_max_delay=3.5, retry_jitter=0)
    async with running_worker(backoff, handlers(lt_retry=once_then_ok)):
        await wait_status(r, task.task_id, "retrying")
        await assert_no_ttl(r, task.task_id)
        h = await wait_status(r, task.task_id, "succeeded", "failed", "dead_lettered")
    assert h["status"] == "succeeded" and calls == [1, 2]
    await assert_retained(r, task.task_id)


# -- the idempotency record lives while its task waits -------------------------------------


async def test_a_duplicate_of_a_task_still_waiting_never_makes_a_second_task(
    q: Queue, r: Redis, short: Settings
) -> None:
    """Past DTQ_IDEM_TTL_S (and the retention) while the first task still waits, a resubmit with
    its key is refused as in progress; once the task ended, the record says so and expires after
    DTQ_IDEM_TTL_S."""
    first = await q.submit("lt_echo", {"n": 1}, idempotency_key="k-wait")
    record_key = keys.idempotency("default", "k-wait")
    start = await redis_ms(r)
    await wait_redis_clock(r, start + OUTLIVE_MS)
    assert await r.ttl(record_key) == -1
    with pytest.raises(IdempotencyInProgressError):
        await q.submit("lt_echo", {"n": 2}, idempotency_key="k-wait")
    assert [t.task_id for t in await q.list()] == [first.task_id]

    async with running_worker(short, handlers(lt_echo=echo)):
        await wait_status(r, first.task_id, "succeeded")
        replay = await q.submit("lt_echo", {"n": 3}, idempotency_key="k-wait")
        record = json.loads(await r.get(record_key))
        assert 0 < await r.pttl(record_key) <= IDEM_TTL_S * 1000
    assert replay.duplicate and replay.task_id == first.task_id
    assert record["task_id"] == first.task_id and record["state"] == "completed"


# -- a record is updated only by the task it names -----------------------------------------


async def permanent(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise PermanentError("no")


async def end_by_cancel(q: Queue, r: Redis, s: Settings, task_id: str) -> None:
    await q.cancel(task_id)


async def end_by_mark_expired(q: Queue, r: Redis, s: Settings, task_id: str) -> None:
    await q.mark_expired(task_id)


async def end_by_purge(q: Queue, r: Redis, s: Settings, task_id: str) -> None:
    assert await q.purge_queue("default") == 1


async def end_by_success(q: Queue, r: Redis, s: Settings, task_id: str) -> None:
    async with running_worker(s, handlers(lt_echo=echo)):
        await wait_status(r, task_id, "succeeded")


async def end_by_dead_letter(q: Queue, r: Redis, s: Settings, task_id: str) -> None:
    async with running_worker(s, handlers(lt_echo=permanent)):
        await wait_status(r, task_id, "dead_lettered")


async def end_by_deadline(q: Queue, r: Redis, s: Settings, task_id: str) -> None:
    """Past its deadline: the worker's start script or its scheduler's sweep expires it."""
    deadline = int(await r.hget(keys.task(task_id), "expires_at_ms") or 0)
    await wait_redis_clock(r, deadline)
    async with running_worker(s, handlers(lt_echo=echo)):
        await wait_status(r, task_id, "expired")


Ending = Callable[[Queue, Redis, Settings, str], Awaitable[None]]
ENDINGS: dict[str, tuple[Ending, dict[str, Any]]] = {
    "cancel": (end_by_cancel, {}),
    "mark_expired": (end_by_mark_expired, {}),
    "purge_queue": (end_by_purge, {}),
    "finish-success": (end_by_success, {}),
    "finish-dead-letter": (end_by_dead_letter, {}),
    "deadline": (end_by_deadline, {"ttl_seconds": 0.3}),
}


@pytest.mark.parametrize("name", list(ENDINGS))
async def test_a_task_never_rewrites_a_record_that_names_another(
    queue: Queue, r: Redis, settings: Settings, name: str
) -> None:
    """A's record is gone (deleted by hand, or expired under an older dtq while A waited) and
    the key now belongs to B (cancelled since, so that a purge of the queue leaves it alone):
    A's terminal state leaves B's record as it is, so a resubmit with the key still finds B."""
    end, options = ENDINGS[name]
    a = await queue.submit("lt_echo", {"who": "a"}, idempotency_key="k-shared", **options)
    record_key = keys.idempotency("default", "k-shared")
    assert await r.delete(record_key) == 1
    b = await queue.submit("lt_echo", {"who": "b"}, idempotency_key="k-shared", delay_seconds=600)
    await queue.cancel(b.task_id)
    before = await r.get(record_key)
    assert json.loads(before)["task_id"] == b.task_id

    await end(queue, r, fast(settings), a.task_id)
    assert (await queue.get(a.task_id)).status.value in {
        "cancelled",
        "expired",
        "succeeded",
        "dead_lettered",
    }
    assert await r.get(record_key) == before
    replay = await queue.submit("lt_echo", {}, idempotency_key="k-shared")
    assert replay.duplicate and replay.task_id == b.task_id


async def test_a_record_that_names_its_task_is_updated(queue: Queue, r: Redis) -> None:
    """The check does not stop a task updating its own record."""
    a = await queue.submit("lt_echo", {}, idempotency_key="k-own")
    await queue.cancel(a.task_id)
    record = json.loads(await r.get(keys.idempotency("default", "k-own")))
    assert record["task_id"] == a.task_id and record["state"] == "failed"


async def test_a_record_whose_task_was_deleted_is_removed(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """A processing record has no TTL; when a worker meets an entry whose task hash was deleted
    by hand, the record that names that task goes too, instead of refusing the key forever."""
    a = await queue.submit("lt_echo", {}, idempotency_key="k-lost")
    assert await r.delete(keys.task(a.task_id)) == 1
    async with running_worker(fast(settings), handlers(lt_echo=echo)):

        async def consumed() -> bool:
            return await r.xlen(keys.stream("default", 5)) == 0

        await wait_until(consumed, 10, "the orphan entry consumed")
    assert await r.get(keys.idempotency("default", "k-lost")) is None
    fresh = await queue.submit("lt_echo", {}, idempotency_key="k-lost")
    assert not fresh.duplicate and fresh.task_id != a.task_id
