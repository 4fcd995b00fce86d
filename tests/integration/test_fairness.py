"""Fairness across keys (docs/limits.md, "Fairness across keys"), against real servers: a queue
with a keyed limit serves its keys in turn, so a key new to the queue is served within one
round however many tasks another key has queued; tasks held back from the streams are QUEUED,
counted in the depth and its admission, can be cancelled, expired and purged, keep their
priorities, and are still moved once the keyed limit is gone.

Orders are asserted from the handlers' own log (the order they started in), never from times."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, TaskStatus, connect, keys
from dtq.calls import FAIR_WINDOW
from dtq.config import Settings
from dtq.errors import QueueFullError
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.worker import fast, handlers

pytestmark = pytest.mark.backends("single", "cluster")

CONCURRENCY = 16


class Order:
    """The tenants in the order their handlers started."""

    def __init__(self) -> None:
        self.started: list[str] = []

    async def handler(self, payload: dict[str, Any], ctx: TaskContext) -> None:
        self.started.append(str(payload.get("tenant")))

    def a_before_each_b(self) -> list[int]:
        """How many A tasks had started before each B task, in B's order."""
        out, a = [], 0
        for tenant in self.started:
            if tenant == "a":
                a += 1
            elif tenant == "b":
                out.append(a)
        return out


async def fair(queue: Queue, **fields: Any) -> None:
    """A keyed limit loose enough never to throttle: only its fairness shows."""
    fields.setdefault("concurrency", 100_000)
    await queue.put_limit("per-tenant", key="payload.tenant", task_type="work", **fields)


async def submit(queue: Queue, tenant: str, n: int, **options: Any) -> list[str]:
    items = [{"task_type": "work", "payload": {"tenant": tenant}, **options}] * n
    out = await queue.submit_many(items)
    assert not [t for t in out if isinstance(t, Exception)]
    return [t.task_id for t in out if not isinstance(t, Exception)]


async def test_a_new_key_is_served_within_one_round(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await fair(queue)
    a = await submit(queue, "a", 3000)
    b = await submit(queue, "b", 10)
    assert await r.zcard(keys.fair_held("default")) == 3010 - FAIR_WINDOW
    order = Order()
    async with running_worker(
        fast(settings), handlers(work=order.handler), concurrency=CONCURRENCY
    ):
        ended = await queue.wait_many(a + b, timeout=120)
    assert all(t.status == TaskStatus.SUCCEEDED for t in ended)
    # The window's entries first, then A and B in turn: the j-th B task after at most the
    # window, j rounds and what one read batch can reorder.
    before = order.a_before_each_b()
    assert len(before) == 10
    for j, n in enumerate(before):
        assert n <= FAIR_WINDOW + j + 1 + CONCURRENCY, before
    assert await r.exists(keys.fair_held("default"), keys.fair_rounds("default")) == 0


async def test_without_a_keyed_limit_the_queue_is_served_in_order(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """The same submits to a queue whose limit has no key: B waits behind all of A."""
    await queue.put_limit("not-keyed", task_type="work", concurrency=100_000)
    a = await submit(queue, "a", 300)
    b = await submit(queue, "b", 10)
    assert await r.exists(keys.fair_held("default")) == 0
    order = Order()
    async with running_worker(fast(settings), handlers(work=order.handler), concurrency=4):
        await queue.wait_many(a + b, timeout=60)
    assert min(order.a_before_each_b()) >= 300 - 4


async def test_held_tasks_are_queued_counted_cancelled_expired_and_purged(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await fair(queue)
    ids = await submit(queue, "a", FAIR_WINDOW + 20)
    held = ids[FAIR_WINDOW:]
    h = await r.hgetall(keys.task(held[0]))
    assert h["status"] == "queued" and "entry_id" not in h and h["fair_key"] == "a"
    assert (await queue.get(held[0])).status == TaskStatus.QUEUED
    assert (await queue.queue_stats("default")).depth == FAIR_WINDOW + 20

    assert (await queue.cancel(held[0])).status == TaskStatus.CANCELLED
    assert (await queue.mark_expired(held[1])).status == TaskStatus.EXPIRED
    assert await r.zscore(keys.fair_held("default"), held[0]) is None
    assert await r.zscore(keys.fair_held("default"), held[1]) is None
    assert await r.zcard(keys.fair_held("default")) == 18

    order = Order()
    async with running_worker(fast(settings), handlers(work=order.handler), concurrency=8):
        ended = await queue.wait_many(ids, timeout=60)
    statuses = [t.status for t in ended]
    assert statuses.count(TaskStatus.SUCCEEDED) == len(ids) - 2
    assert len(order.started) == len(ids) - 2  # the cancelled and the expired never ran

    more = await submit(queue, "a", FAIR_WINDOW + 5)
    assert await r.zcard(keys.fair_held("default")) == 5
    assert await queue.purge_queue("default") == FAIR_WINDOW + 5
    assert await r.zcard(keys.fair_held("default")) == 0
    assert {(await queue.get(t)).status for t in more} == {TaskStatus.CANCELLED}


async def test_held_tasks_count_toward_the_queue_depth_limit(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await fair(queue)
    assert FAIR_WINDOW + 3 == 67
    small = await connect(settings=Settings(**{**settings.model_dump(), "max_queue_depth": 67}))
    try:
        await submit(small, "a", 67)
        assert await r.zcard(keys.fair_held("default")) == 3
        with pytest.raises(QueueFullError):
            await small.submit("work", {"tenant": "b"})
    finally:
        await small.close()


async def test_priorities_hold_within_a_fair_queue(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """A high-priority task held behind many of its own key goes into its stream first."""
    await fair(queue)
    low = await submit(queue, "a", 500, priority=2)
    urgent = (await queue.submit("work", {"tenant": "urgent-a"}, priority=9)).task_id
    order = Order()
    async with running_worker(
        fast(settings), handlers(work=order.handler), concurrency=CONCURRENCY
    ):
        await queue.wait_many([*low, urgent], timeout=60)
    assert order.started.index("urgent-a") <= FAIR_WINDOW + CONCURRENCY


async def test_held_tasks_still_move_once_the_keyed_limit_is_gone(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    await fair(queue)
    ids = await submit(queue, "a", FAIR_WINDOW + 30)
    await queue.delete_limit("per-tenant")
    assert await r.hget(keys.fair("default"), "key") is None
    after = await submit(queue, "b", 5)  # straight into the streams now
    for t in after:
        assert "entry_id" in await r.hgetall(keys.task(t))
    order = Order()
    async with running_worker(fast(settings), handlers(work=order.handler), concurrency=8):
        ended = await queue.wait_many([*ids, *after], timeout=60)
    assert {t.status for t in ended} == {TaskStatus.SUCCEEDED}

    async def drained() -> bool:
        return await r.zcard(keys.fair_held("default")) == 0

    await wait_until(drained, 10, "nothing held")


async def test_a_second_keyed_limit_keeps_the_first_ones_key(queue: Queue, r: Redis) -> None:
    """The fairness path is the key of the queue's first keyed limit by name."""
    await queue.put_limit("b-limit", key="payload.region", concurrency=5)
    assert await r.hget(keys.fair("default"), "key") == "payload.region"
    await queue.put_limit("a-limit", key="payload.tenant", rate="10/s")
    assert await r.hget(keys.fair("default"), "key") == "payload.tenant"
    await queue.delete_limit("a-limit")
    assert await r.hget(keys.fair("default"), "key") == "payload.region"
    await queue.put_limit("b-limit", concurrency=5)  # no key any more
    assert await r.hget(keys.fair("default"), "key") is None


async def test_delayed_tasks_that_come_due_join_their_keys_turn(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """Promoted by the scheduler, a delayed task goes through the same turn as a submit. The
    queue is paused while they come due, so the order they are served in is the turn's alone
    (not how far the worker got while the scheduler promoted them)."""
    await fair(queue)
    a = await submit(queue, "a", 1000, delay_seconds=1)
    b = await submit(queue, "b", 5, delay_seconds=1)
    await queue.pause_queue("default")
    order = Order()
    async with running_worker(fast(settings), handlers(work=order.handler), concurrency=4):

        async def all_promoted() -> bool:
            scheduled = await r.zcard(keys.retry_schedule("default"))
            return scheduled + await r.zcard(keys.retry_claimed("default")) == 0

        await wait_until(all_promoted, 30, "every delayed task promoted")
        assert await r.zcard(keys.fair_held("default")) == 1005 - FAIR_WINDOW
        await queue.resume_queue("default")
        ended = await queue.wait_many(a + b, timeout=60)
    assert {t.status for t in ended} == {TaskStatus.SUCCEEDED}
    before = order.a_before_each_b()
    assert len(before) == 5
    for j, n in enumerate(before):
        assert n <= FAIR_WINDOW + j + 1 + 4, before
