"""Every script that makes a workflow node's task terminal appends its end to the task's queue's
outbox in the same step (retain in _lib.lua; docs/workflows.md): one entry {task_id, status,
key} per end, on every terminal path, and none for any other task. The tasks are submitted
with a node's idempotency key by hand, so no workflow (and no relay) is involved."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.admin.tasks import sweep_due
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.errors import TaskRunningError
from dtq.worker.scheduler import Scheduler
from dtq_tasks import PermanentError, TaskContext
from support import running_worker, wait_until
from support.worker import fast, handlers, wait_status

pytestmark = pytest.mark.backends("single", "cluster")

KEY = "dtq-wf:w1:a"


async def outbox(r: Redis, queue: str = "default") -> list[dict[str, str]]:
    return [fields for _, fields in await r.xrange(keys.wf_outbox(queue))]


async def test_a_succeeded_node_is_told_once_and_its_result_kept(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    node = await queue.submit("work", {"n": 1}, idempotency_key=KEY)
    plain = await queue.submit("work", {"n": 2}, idempotency_key="user-key")
    other = await queue.submit("work", {"n": 3})

    async def work(payload: dict[str, Any], ctx: TaskContext) -> int:
        return int(payload["n"])

    # No workflow w1 exists: the worker's relay applies nothing, and deletes the entry.
    async with running_worker(fast(settings), handlers(work=work)) as worker:
        for t in (node, plain, other):
            await wait_status(r, t.task_id, "succeeded")

        async def relayed() -> bool:
            return worker.workflows.applied == 1

        await wait_until(relayed, what="the relay to take the entry")
        assert worker.workflows.applied == 1  # the node's end only
    assert await outbox(r) == []
    # Its workflow is gone (never was): the relay gave the result its retention at once.
    assert await r.ttl(keys.result(node.task_id)) > 0


@pytest.mark.parametrize("path", ["dead_lettered", "cancelled", "running_cancelled"])
async def test_each_end_of_a_run_is_told(
    queue: Queue, settings: Settings, r: Redis, path: str
) -> None:
    go = asyncio.Event()

    async def work(payload: dict[str, Any], ctx: TaskContext) -> None:
        if path == "dead_lettered":
            raise PermanentError("no")
        await go.wait()

    t = await queue.submit("work", idempotency_key=KEY, max_attempts=1)
    if path == "cancelled":
        await queue.cancel(t.task_id)
        assert await outbox(r) == [{"task_id": t.task_id, "status": "cancelled", "key": KEY}]
        return
    async with running_worker(fast(settings), handlers(work=work)) as worker:
        if path == "running_cancelled":
            await wait_status(r, t.task_id, "running")
            with pytest.raises(TaskRunningError):
                await queue.cancel(t.task_id)  # requested: the worker stops the handler
        await wait_status(r, t.task_id, path.removeprefix("running_"))

        async def relayed() -> bool:
            return worker.workflows.applied == 1

        await wait_until(relayed, what="the relay to take the one entry")
    assert await outbox(r) == []  # applied, then deleted


async def test_ends_without_a_run_are_told(queue: Queue, settings: Settings, r: Redis) -> None:
    """Cancelled, expired by hand, expired by the sweep, expired at its promotion, purged."""
    cancelled = await queue.submit("work", queue="wf", idempotency_key="dtq-wf:w1:c")
    await queue.cancel(cancelled.task_id)
    marked = await queue.submit("work", queue="wf", idempotency_key="dtq-wf:w1:m")
    await queue.mark_expired(marked.task_id)
    swept = await queue.submit("work", queue="wf", idempotency_key="dtq-wf:w1:s", ttl_seconds=0.05)
    delayed = await queue.submit(
        "work", queue="wf", idempotency_key="dtq-wf:w1:d", delay_seconds=0.05, ttl_seconds=0.06
    )
    purged = await queue.submit("work", queue="wf", idempotency_key="dtq-wf:w1:p")
    plain = await queue.submit("work", queue="wf", idempotency_key="user")
    await queue.cancel(plain.task_id)

    async def past() -> bool:
        return await redis_time_ms(r) > swept.created_at.timestamp() * 1000 + 200

    await wait_until(past, what="the deadlines to pass")
    scheduler = Scheduler(queue.store, fast(settings), "leader-test")
    await scheduler.tick()  # promotes the delayed task (expired) and sweeps the other
    await sweep_due(queue.store, await redis_time_ms(r))
    await queue.purge_queue("wf")
    got = {e["task_id"]: (e["status"], e["key"]) for e in await outbox(r, "wf")}
    assert got == {
        cancelled.task_id: ("cancelled", "dtq-wf:w1:c"),
        marked.task_id: ("expired", "dtq-wf:w1:m"),
        swept.task_id: ("expired", "dtq-wf:w1:s"),
        delayed.task_id: ("expired", "dtq-wf:w1:d"),
        purged.task_id: ("cancelled", "dtq-wf:w1:p"),
    }
    assert len(await outbox(r, "wf")) == 5  # one entry per end
