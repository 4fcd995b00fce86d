"""Bookkeeping the scripts skip when it would change nothing, checked where it would: the history
cap (``hist`` trims only a list past 100 entries) and the last attempt's outcome fields that
``start.lua`` clears when a task runs again (a first attempt has none)."""

from __future__ import annotations

import json

from redis.asyncio import Redis
from test_worker_support import finish_as, read_as, start_as

from dtq import Queue, keys
from dtq.calls import Outcome
from dtq.config import Settings
from dtq.worker.scheduler import Scheduler

OUTCOME_FIELDS = ("finished_at", "duration_ms", "error_class", "error_message", "retryable")


async def test_history_keeps_the_last_100_entries(queue: Queue, r: Redis) -> None:
    task = await queue.submit("echo_task", {})
    ts = "2026-01-01T00:00:00.000Z"
    old = [json.dumps({"ts": ts, "to": "queued", "n": i}) for i in range(99)]
    await r.rpush(keys.history(task.task_id), *old)  # 1 + 99: exactly at the cap
    await queue.cancel(task.task_id)
    raw = await r.lrange(keys.history(task.task_id), 0, -1)
    assert len(raw) == 100
    assert json.loads(raw[0])["n"] == 0  # the submit's entry went, the rest stayed
    assert json.loads(raw[-1])["to"] == "cancelled"
    assert [h.to_status for h in (await queue.history(task.task_id))[-1:]] == ["cancelled"]


async def test_a_retry_runs_without_the_last_attempts_outcome(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    task = await queue.submit("echo_task", {}, max_attempts=3)
    entry = await read_as(r, "worker-0000a001")
    first = await start_as(r, entry, "worker-0000a001", settings)
    h = await r.hgetall(keys.task(task.task_id))
    assert first.attempt == 1 and h["status"] == "running"
    assert not set(OUTCOME_FIELDS) & set(h)
    failed = Outcome(
        "error", duration_ms=7, error_class="RetryableError", error_message="x", retryable=True
    )
    assert (await finish_as(r, entry, 1, failed, "worker-0000a001", settings)).status == "retrying"
    h = await r.hgetall(keys.task(task.task_id))
    assert {f: h[f] for f in ("error_class", "error_message", "retryable")} == {
        "error_class": "RetryableError",
        "error_message": "x",
        "retryable": "1",
    }
    await r.zadd(keys.RETRY_SCHEDULE, {task.task_id: 0})  # due now
    tick = await Scheduler(queue.store, settings, "worker-5c4ed001").tick()
    assert tick.retried == [task.task_id]
    again = await read_as(r, "worker-0000a002")
    assert (await start_as(r, again, "worker-0000a002", settings)).attempt == 2
    h = await r.hgetall(keys.task(task.task_id))
    assert h["status"] == "running" and h["attempt"] == "2"
    assert not set(OUTCOME_FIELDS) & set(h)
