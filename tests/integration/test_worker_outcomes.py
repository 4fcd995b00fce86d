"""How executions end (contract sections 1, 4, 5; DESIGN 7): retries within the jitter bounds,
dead letters with every field, FAILED without a DLQ, permanent errors, unknown types, invalid
payloads, timeouts, reschedules, results, the idempotency record, and the finish fencing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel, Field
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.calls import Outcome
from dtq.config import Settings
from dtq_tasks import (
    Handler,
    PermanentError,
    RescheduleError,
    RetryableError,
    TaskContext,
)
from support import running_worker, wait_until
from support.worker import DLQ_FIELDS, fast, finish_as, handlers, read_as, start_as, wait_status

pytestmark = pytest.mark.backends("single", "cluster")


async def flaky(payload: dict[str, Any], ctx: TaskContext) -> dict[str, int]:
    if ctx.attempt <= payload["fail_times"]:
        raise RetryableError(f"flaky {ctx.attempt}")
    return {"attempt": ctx.attempt}


async def always_fail(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise RetryableError("always\nfails " + "x" * 50)


async def permanent(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise PermanentError("bad input")


async def unexpected(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise KeyError("surprise")


async def too_slow(payload: dict[str, Any], ctx: TaskContext) -> None:
    await asyncio.sleep(10)


async def big_result(payload: dict[str, Any], ctx: TaskContext) -> str:
    return "x" * payload["n"]


async def not_json(payload: dict[str, Any], ctx: TaskContext) -> object:
    return object()


def bounds_ms(attempt: int, s: Settings) -> tuple[float, float]:
    capped = min(s.retry_max_delay, s.retry_base_delay * 2 ** (attempt - 1))
    return capped * (1 - s.retry_jitter) * 1000 - 1, capped * (1 + s.retry_jitter) * 1000 + 1


async def test_flaky_succeeds_on_attempt_after_fail_times_with_delays_in_bounds(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    s = fast(settings, retry_base_delay=0.05, retry_max_delay=0.15, retry_jitter=0.2)
    task = await queue.submit("wt_flaky", {"fail_times": 3}, max_attempts=5)
    async with running_worker(s, handlers(wt_flaky=flaky)):
        h = await wait_status(r, task.task_id, "succeeded")
    assert h["attempt"] == "4"
    done = await queue.get(task.task_id)
    assert done.result == {"attempt": 4}
    history = await queue.history(task.task_id)
    retries = [x for x in history if x.to_status == "retrying"]
    assert [x.attempt for x in retries] == [1, 2, 3]
    for entry in retries:
        low, high = bounds_ms(entry.attempt, s)
        assert low <= entry.details["retry_delay_ms"] <= high, (entry.attempt, entry.details)
        assert entry.details["error_class"] == "RetryableError"
    # attempt 3: 0.05 * 4 = 0.2 > max 0.15: capped
    assert retries[2].details["retry_delay_ms"] <= 0.15 * 1.2 * 1000 + 1
    statuses = [x.to_status for x in history]
    assert statuses == ["queued"] + ["running", "retrying", "queued"] * 3 + [
        "running",
        "succeeded",
    ]


async def test_always_fail_is_dead_lettered_with_every_dlq_field(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit(
        "wt_fail", {"p": 1}, max_attempts=3, priority=7, idempotency_key="k-fail"
    )
    async with running_worker(fast(settings), handlers(wt_fail=always_fail)) as w:
        h = await wait_status(r, task.task_id, "dead_lettered")
    assert h["attempt"] == "3" and h["error_class"] == "RetryableError"
    assert "\n" not in h["error_message"] and h["retryable"] == "1"
    [(dlq_id, fields)] = await r.xrange(keys.dead_letter("default"))
    assert set(fields) == DLQ_FIELDS
    assert h["dlq_entry_id"] == dlq_id
    assert fields["task_id"] == task.task_id and fields["queue"] == "default"
    assert fields["original_queue"] == "default" and fields["task_type"] == "wt_fail"
    assert json.loads(fields["payload"]) == {"p": 1}
    assert fields["attempt"] == "3" and fields["attempts_made"] == "3"
    assert fields["max_attempts"] == "3" and fields["priority"] == "7"
    assert fields["last_error"] == h["error_message"]
    assert fields["last_error_class"] == "RetryableError" and fields["retryable"] == "1"
    assert fields["worker_id"] == w.worker_id and fields["idempotency_key"] == "k-fail"
    assert int(fields["failed_at_ms"]) > 0
    assert json.loads(await r.get(keys.idempotency("default", "k-fail")))["state"] == "failed"
    assert await r.xlen(keys.stream("default", 7)) == 0


async def test_always_fail_with_dlq_disabled_is_failed(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit("wt_fail", {}, max_attempts=2)
    async with running_worker(fast(settings, dlq_enabled=False), handlers(wt_fail=always_fail)):
        h = await wait_status(r, task.task_id, "failed")
    assert h["attempt"] == "2"
    assert "dlq_entry_id" not in h
    assert await r.xlen(keys.dead_letter("default")) == 0


@pytest.mark.parametrize(
    ("task_type", "payload", "error_class", "message"),
    [
        ("wt_permanent", {}, "PermanentError", "bad input"),
        ("wt_unexpected", {}, "KeyError", "'surprise'"),
        ("wt_unknown", {}, "UnknownTaskType", "unknown_task_type:wt_unknown"),
        ("wt_not_json", {}, "ResultNotSerializable", None),
    ],
)
async def test_permanent_errors_end_after_one_attempt(
    settings: Settings,
    r: Redis,
    queue: Queue,
    task_type: str,
    payload: dict[str, Any],
    error_class: str,
    message: str | None,
) -> None:
    task = await queue.submit(task_type, payload, max_attempts=5)
    hs = handlers(wt_permanent=permanent, wt_unexpected=unexpected, wt_not_json=not_json)
    async with running_worker(fast(settings), hs):
        h = await wait_status(r, task.task_id, "dead_lettered")
    assert h["attempt"] == "1" and h["error_class"] == error_class and h["retryable"] == "0"
    if message is not None:
        assert h["error_message"] == message
    [(_, fields)] = await r.xrange(keys.dead_letter("default"))
    assert fields["last_error_class"] == error_class


class Bounded(BaseModel):
    n: int = Field(ge=0, le=10)


async def test_invalid_payload_is_permanent_and_handler_not_called(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    seen: list[dict[str, Any]] = []

    async def typed(payload: dict[str, Any], ctx: TaskContext) -> int:
        seen.append(payload)
        return int(payload["n"])

    hs = {"wt_typed": Handler("wt_typed", typed, Bounded)}
    bad = await queue.submit("wt_typed", {"n": 99}, max_attempts=3)
    good = await queue.submit("wt_typed", {"n": "7"})
    async with running_worker(fast(settings), hs):
        h = await wait_status(r, bad.task_id, "dead_lettered")
        await wait_status(r, good.task_id, "succeeded")
    assert h["error_class"] == "ValidationError" and h["attempt"] == "1"
    assert seen == [{"n": 7}]  # the validated payload (coerced), the invalid one never


async def returns_none(payload: dict[str, Any], ctx: TaskContext) -> None:
    return None


async def test_none_result_stores_no_result_key(settings: Settings, r: Redis, queue: Queue) -> None:
    """A handler that returns None leaves no dtq:result key; get() still shows result None."""
    task = await queue.submit("wt_none", {})
    falsy = await queue.submit("wt_big", {"n": 0})  # "" is a result, and is stored
    async with running_worker(fast(settings), handlers(wt_none=returns_none, wt_big=big_result)):
        await wait_status(r, task.task_id, "succeeded")
        await wait_status(r, falsy.task_id, "succeeded")
    assert not await r.exists(keys.result(task.task_id))
    got = await queue.get(task.task_id)
    assert got.result is None and not got.result_truncated
    assert (await queue.store.get_many([task.task_id]))[0].result is None
    assert await r.get(keys.result(falsy.task_id)) == '""'
    assert (await queue.get(falsy.task_id)).result == ""


async def test_timeout_is_retryable(settings: Settings, r: Redis, queue: Queue) -> None:
    task = await queue.submit("wt_slow", {}, max_attempts=2, timeout_ms=100)
    async with running_worker(fast(settings), handlers(wt_slow=too_slow)):
        h = await wait_status(r, task.task_id, "dead_lettered")
    assert h["error_class"] == "TimeoutError" and h["retryable"] == "1"
    assert "timeout_ms=100" in h["error_message"]
    history = await queue.history(task.task_id)
    assert [x.to_status for x in history].count("retrying") == 1


async def test_result_storage_and_truncation(settings: Settings, r: Redis, queue: Queue) -> None:
    s = fast(settings, result_max_bytes=100, result_retention_s=50)
    small = await queue.submit("wt_big", {"n": 10}, idempotency_key="k-ok")
    large = await queue.submit("wt_big", {"n": 500})
    async with running_worker(s, handlers(wt_big=big_result)):
        await wait_status(r, small.task_id, "succeeded")
        await wait_status(r, large.task_id, "succeeded")
    assert (await queue.get(small.task_id)).result == "x" * 10
    assert 0 < await r.ttl(keys.result(small.task_id)) <= 50
    big = await queue.get(large.task_id)
    assert big.result is None and big.result_truncated
    assert not await r.exists(keys.result(large.task_id))
    assert json.loads(await r.get(keys.idempotency("default", "k-ok")))["state"] == "completed"
    h = await r.hgetall(keys.task(small.task_id))
    assert {"started_at", "finished_at", "duration_ms", "worker_id"} <= set(h)
    assert 0 < await r.ttl(keys.task(small.task_id)) <= s.task_retention_s


async def test_reschedule_with_extension_then_limit(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    async def resched(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise RescheduleError(delay_seconds=0.05, extend_expiration_seconds=100)

    task = await queue.submit("wt_resched", {}, max_attempts=3, ttl_seconds=60)
    assert task.expires_at is not None
    async with running_worker(fast(settings), handlers(wt_resched=resched)):
        h = await wait_status(r, task.task_id, "dead_lettered")
    assert h["error_class"] == "RescheduleLimit"
    history = await queue.history(task.task_id)
    rescheduled = [x for x in history if x.to_status == "retrying"]
    assert len(rescheduled) == 2 and all(x.reason == "reschedule" for x in rescheduled)
    assert all(x.details["retry_delay_ms"] == 50 for x in rescheduled)
    assert [x.details["extended_ms"] for x in rescheduled] == [100_000, 100_000]
    final = await queue.get(task.task_id)
    assert final.expires_at is not None
    moved = (final.expires_at - task.expires_at).total_seconds()
    assert moved == pytest.approx(200, abs=0.01)


async def test_reschedule_is_a_retrying_attempt_without_error(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    async def once(payload: dict[str, Any], ctx: TaskContext) -> int:
        if ctx.attempt == 1:
            raise RescheduleError(0.05)
        return ctx.attempt

    task = await queue.submit("wt_once", {})
    async with running_worker(fast(settings), handlers(wt_once=once)):
        h = await wait_status(r, task.task_id, "succeeded")
    assert h["attempt"] == "2" and not h.get("error_class")
    history = await queue.history(task.task_id)
    retry = next(x for x in history if x.to_status == "retrying")
    assert "error_class" not in retry.details


async def test_finish_is_fenced_for_a_stale_attempt(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """A worker whose entry was reclaimed by another writes nothing and ACKs nothing."""
    task = await queue.submit("wt_x", {})
    entry = await read_as(r, "worker-zombie00")
    await start_as(r, entry, "worker-zombie00", settings)
    # The entry is reclaimed by worker-other000 and started again (attempt 2).
    await r.xclaim(entry.stream, keys.CONSUMER_GROUP, "worker-other000", 0, [entry.entry_id])
    assert (await start_as(r, entry, "worker-other000", settings)).attempt == 2
    before = await r.hgetall(keys.task(task.task_id))
    history_len = await r.llen(keys.history(task.task_id))
    outcome = Outcome("success", duration_ms=5, result_json='"zombie"')
    for worker_id, attempt in (
        ("worker-zombie00", 1),
        ("worker-zombie00", 2),
        ("worker-other000", 1),
    ):
        reply = await finish_as(r, entry, attempt, outcome, worker_id, settings)
        assert reply.status == "fenced", (worker_id, attempt, reply)
    assert await r.hgetall(keys.task(task.task_id)) == before
    assert await r.llen(keys.history(task.task_id)) == history_len
    assert not await r.exists(keys.result(task.task_id))
    [pending] = await r.xpending_range(entry.stream, keys.CONSUMER_GROUP, "-", "+", 10)
    assert pending["consumer"] == "worker-other000"
    # The owner's finish goes through.
    done = await finish_as(r, entry, 2, outcome, "worker-other000", settings)
    assert done.status == "succeeded"
    assert await r.xlen(entry.stream) == 0


async def test_a_long_reschedule_keeps_the_task_past_its_wait(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    """A task rescheduled 30 days out with 7 days of retention keeps its hash (payload
    included) and history with no TTL: it must not expire while it waits to run (DESIGN 11)."""
    task = await queue.submit("wt_x", {"x": 1})
    entry = await read_as(r, "worker-sched000")
    await start_as(r, entry, "worker-sched000", settings)
    wait_ms = 30 * 86_400_000
    reschedule = Outcome("reschedule", delay_ms=wait_ms)
    assert (await finish_as(r, entry, 1, reschedule, "worker-sched000", settings)).status == (
        "retrying"
    )
    assert wait_ms // 1000 > settings.task_retention_s
    for key in (keys.task(task.task_id), keys.history(task.task_id)):
        assert await r.ttl(key) == -1, key


async def test_retry_keeps_expires_at_and_expires_instead_of_running(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    calls: list[int] = []

    async def fail_once(payload: dict[str, Any], ctx: TaskContext) -> None:
        calls.append(ctx.attempt)
        raise RetryableError("again")

    s = fast(settings, retry_base_delay=2.0, retry_max_delay=2.0, retry_jitter=0.0)
    async with running_worker(s, handlers(wt_f1=fail_once)):
        # Submitted once the worker serves: a start-up slower than the 1 s TTL (a loaded
        # machine) would let the task expire before its first attempt.
        task = await queue.submit("wt_f1", {}, max_attempts=5, ttl_seconds=1.0)
        await wait_status(r, task.task_id, "retrying")
        assert await r.zscore(keys.expiry("default"), task.task_id) is not None
        h = await wait_status(r, task.task_id, "expired", timeout_s=5)
    assert calls == [1]
    assert h["expires_at"] == (await r.hget(keys.task(task.task_id), "expires_at"))
    assert await r.zscore(keys.retry_schedule("default"), task.task_id) is None


async def test_idempotent_submission_maps_to_one_task_and_record_completes(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    async def echo(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return {"key": ctx.idempotency_key}

    task = await queue.submit("wt_echo2", {}, idempotency_key="order-1")
    async with running_worker(fast(settings), handlers(wt_echo2=echo)):
        await wait_status(r, task.task_id, "succeeded")

        async def recorded() -> bool:
            raw = await r.get(keys.idempotency("default", "order-1"))
            return raw is not None and json.loads(raw)["state"] == "completed"

        await wait_until(recorded, 5, "idempotency completed")
    again = await queue.submit("wt_echo2", {}, idempotency_key="order-1")
    assert again.duplicate and again.task_id == task.task_id
    assert again.result == {"key": "order-1"}
