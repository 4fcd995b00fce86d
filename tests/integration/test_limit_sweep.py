"""The places of a concurrency limit can never leak (docs/limits.md, "Places that nothing
holds"): a place whose task is not RUNNING (its hash gone, or ended by a start or finish that no
longer named the limit) is given back by the workers' sweep, and its waiter promoted; a RUNNING
task's place is never touched; deleting a limit deletes its state, keyed or not, so a limit
created again under its name starts clean, and a task parked for one of its places comes back
by itself.

A dead worker's leftovers are written by hand: a member of the running set whose task hash is
missing or in another status than running is what a worker that died holding the place, with
the limit deleted or narrowed before its task was redelivered, leaves behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, TaskStatus, calls, keys
from dtq.config import Settings
from dtq.limits import LimitDef
from dtq.metrics import Metrics
from dtq.scripts import Scripts
from dtq.store import Store
from dtq.worker import Worker
from dtq.worker.limits import LimitCache, PlaceSweeper
from dtq.worker.observer import PlacesSwept
from dtq.worker.telemetry import MetricsObserver
from dtq_tasks import TaskContext
from support import started, wait_until
from support.worker import fast, handlers

pytestmark = pytest.mark.backends("single", "cluster")

SWEEP = {"limit_sweep_s": 0.2}  # every pass of the limits loop (about a second) sweeps


async def define(r: Redis, name: str, **fields: Any) -> None:
    d = LimitDef.parse(fields)
    await r.hset(keys.limits(d.queue), name, d.to_json())


def running_set(name: str, key_value: str = "") -> str:
    return keys.limit_state("default", name, key_value) + ":running"


def waiting_set(name: str, key_value: str = "") -> str:
    return keys.limit_state("default", name, key_value) + ":waiting"


async def phantom(r: Redis, name: str, key_value: str = "", status: str | None = None) -> str:
    """A place left by a task that no longer runs: its hash in ``status`` (None: no hash)."""
    task_id = calls.new_task_id("default")
    if status is not None:
        await r.hset(keys.task(task_id), mapping={"status": status, "queue": "default"})
    await r.zadd(running_set(name, key_value), {task_id: 1})
    return task_id


@pytest.fixture
async def store(r: Redis, settings: Settings) -> AsyncIterator[Store]:
    yield Store(r, Scripts(), settings)


async def sweeper(store: Store, on_swept: Any = None) -> PlaceSweeper:
    cache = LimitCache(store, ["default"])
    await cache.refresh()
    return PlaceSweeper(store, cache, 0.001, on_swept)  # a claim of 1 ms: each call sweeps


async def _status_is(queue: Queue, task_id: str, status: str) -> bool:
    return (await queue.get(task_id)).status == status


async def test_a_phantom_place_is_given_back_and_a_stalled_queue_runs_again(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """concurrency=1 with its one place held by an ended task: without the sweep no task of
    the limit ever starts again (each is parked and re-parked every 30 s)."""
    await define(r, "solo", task_type="work", concurrency=1)
    gone = await phantom(r, "solo", status=None)
    ended = await phantom(r, "solo", status="dead_lettered")
    metrics = Metrics()
    worker = Worker(
        fast(settings, **SWEEP),
        handlers=handlers(work=lambda payload, ctx: ctx.attempt),
        concurrency=4,
        observers=[MetricsObserver(metrics, "w")],
    )
    async with started(worker):
        tasks = [await queue.submit("work", {}, max_attempts=1) for _ in range(3)]
        done = await queue.wait_many([t.task_id for t in tasks], timeout=20)
    assert all(t.status == TaskStatus.SUCCEEDED and t.result == 1 for t in done)
    assert await r.zcard(running_set("solo")) == 0
    assert not await r.zscore(running_set("solo"), gone)
    assert not await r.zscore(running_set("solo"), ended)
    swept = metrics.registry.get_sample_value(
        "dtq_limit_places_swept_total", {"queue": "default", "limit": "solo"}
    )
    # Both phantoms are gone in one sweep (one page); a second cannot find them again.
    assert swept == 2


async def test_a_running_tasks_place_is_never_swept(
    queue: Queue, settings: Settings, r: Redis, store: Store
) -> None:
    """A RUNNING task holds its place through any number of sweeps; the task parked behind it
    stays parked (the limit is still full)."""
    await define(r, "solo", task_type="hold", concurrency=1)
    go = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        await go.wait()

    async with started(
        Worker(fast(settings, **SWEEP), handlers=handlers(hold=hold), concurrency=4)
    ):
        first = await queue.submit("hold", {})
        await wait_until(lambda: _status_is(queue, first.task_id, "running"), 10, "it runs")
        second = await queue.submit("hold", {})
        await wait_until(lambda: _status_is(queue, second.task_id, "pending"), 10, "parked")
        sweep = await sweeper(store)
        for _ in range(5):
            assert await sweep.sweep() == []
        assert await r.zrange(running_set("solo"), 0, -1) == [first.task_id]
        assert await r.zrange(waiting_set("solo"), 0, -1) == [second.task_id]
        assert (await queue.get(second.task_id)).status == TaskStatus.PENDING
        go.set()
        done = await queue.wait_many([first.task_id, second.task_id], timeout=20)
    assert all(t.status == TaskStatus.SUCCEEDED for t in done)


async def test_the_script_removes_only_members_not_running_and_promotes_a_waiter_each(
    r: Redis, store: Store
) -> None:
    """limit_sweep.lua on one page: the running member stays; a missing hash and each status
    other than running go, each freeing a place that makes one waiter due now."""
    await define(r, "four", task_type="work", concurrency=4)
    live = await phantom(r, "four", status="running")
    dead = [await phantom(r, "four", status=s) for s in (None, "succeeded", "retrying", "pending")]
    schedule = keys.retry_schedule("default")
    later = int(time.time() * 1000) + 60_000
    waiters = [calls.new_task_id("default") for _ in range(5)]
    for n, w in enumerate(waiters):
        await r.zadd(waiting_set("four"), {w: n})
        await r.zadd(schedule, {w: later})
    members = await r.zrange(running_set("four"), 0, -1)
    [removed] = await calls.limit_sweep_many(
        store, [calls.limit_sweep_call("default", keys.limit_state("default", "four"), members)]
    )
    assert isinstance(removed, list) and sorted(removed) == sorted(dead)
    assert await r.zrange(running_set("four"), 0, -1) == [live]
    due = {w: await r.zscore(schedule, w) for w in waiters}
    assert [w for w in waiters if due[w] != later] == waiters[:4]  # one waiter per place
    assert await r.zrange(waiting_set("four"), 0, -1) == waiters[4:]
    again = await calls.limit_sweep_many(
        store, [calls.limit_sweep_call("default", keys.limit_state("default", "four"), members)]
    )
    assert again == [[]]  # idempotent: a place is given back once


async def test_a_keyed_limits_phantom_places_are_swept_per_key_value(
    queue: Queue, settings: Settings, r: Redis, store: Store
) -> None:
    await define(r, "per-tenant", task_type="work", key="payload.tenant", concurrency=1)
    a = await phantom(r, "per-tenant", "a", status="failed")
    b_live = await phantom(r, "per-tenant", "b", status="running")
    await r.set(running_set("per-tenant", "junk"), "not dtq's")  # not a zset: skipped
    seen: list[PlacesSwept] = []
    assert await (await sweeper(store, seen.append)).sweep() == seen
    assert [(s.limit, s.task_ids) for s in seen] == [("per-tenant", (a,))]
    assert await r.zcard(running_set("per-tenant", "a")) == 0
    assert await r.zrange(running_set("per-tenant", "b"), 0, -1) == [b_live]
    # the end to end: tenant a's queue was stalled by its phantom, now it runs
    await phantom(r, "per-tenant", "a", status="expired")
    async with started(
        Worker(
            fast(settings, **SWEEP),
            handlers=handlers(work=lambda payload, ctx: payload["tenant"]),
            concurrency=4,
        )
    ):
        task = await queue.submit("work", {"tenant": "a"})
        assert await queue.result(task.task_id, timeout=20) == "a"


async def test_a_deleted_limit_takes_its_state_and_a_recreated_one_starts_clean(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """Deleting a limit deletes its rate, running and waiting keys in the delete script; a
    phantom written after it (a worker that started a task on the definitions it read before
    the delete, then died) is swept once the limit exists again."""
    await queue.put_limit("solo", task_type="work", concurrency=1, rate="100/s")
    prefix = keys.limit_state("default", "solo")
    await phantom(r, "solo", status="running")  # a task running when the limit goes
    await r.zadd(waiting_set("solo"), {calls.new_task_id("default"): 1})
    await r.hset(prefix + ":rate", "tat", 1)
    await queue.delete_limit("solo")
    assert await r.exists(prefix + ":rate", prefix + ":running", prefix + ":waiting") == 0
    stale = await phantom(r, "solo", status="running")  # its worker dies...
    await r.hset(keys.task(stale), "status", "dead_lettered")  # ...and its redelivery ends it
    await queue.put_limit("solo", task_type="work", concurrency=1)
    async with started(
        Worker(
            fast(settings, **SWEEP),
            handlers=handlers(work=lambda payload, ctx: ctx.attempt),
            concurrency=4,
        )
    ):
        tasks = [await queue.submit("work", {}, max_attempts=1) for _ in range(2)]
        done = await queue.wait_many([t.task_id for t in tasks], timeout=20)
    assert all(t.status == TaskStatus.SUCCEEDED for t in done)
    assert await r.zcard(running_set("solo")) == 0


async def test_a_deleted_keyed_limit_takes_the_state_of_every_key_value(
    queue: Queue, r: Redis, store: Store
) -> None:
    await queue.put_limit("per-tenant", key="payload.tenant", concurrency=1)
    for value in ("a", "b", "c"):
        await phantom(r, "per-tenant", value, status="running")
        await r.zadd(waiting_set("per-tenant", value), {calls.new_task_id("default"): 1})
    await r.hset(keys.limit_state("default", "per-tenant", "d") + ":rate", "tat", 1)
    other = await phantom(r, "per-tenantx", "a", status="running")  # another limit's: stays
    await queue.delete_limit("per-tenant")
    prefix = keys.limit_state("default", "per-tenant")
    left = [k async for k in r.scan_iter(match=prefix + "[=:]*")]
    assert left == []
    assert await r.zrange(running_set("per-tenantx", "a"), 0, -1) == [other]
    # A state delete that comes after the limit was created again leaves the new one's state.
    await queue.put_limit("per-tenant", key="payload.tenant", concurrency=1)
    kept = await phantom(r, "per-tenant", "a", status="running")
    assert (
        await calls.limit_delete_state(
            store, "per-tenant", "default", [running_set("per-tenant", "a")]
        )
        is None
    )
    assert await r.zrange(running_set("per-tenant", "a"), 0, -1) == [kept]


async def test_a_task_parked_in_a_deleted_limit_comes_back_by_itself(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """The delete takes the waiting set, so no finish promotes the parked task: it is due again
    30 s after its park (PARKED_RECHECK_MS, made due by hand here) and then starts, the limit
    gone, while the first still runs."""
    await queue.put_limit("solo", task_type="hold", concurrency=1)
    go = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        if payload.get("first"):
            await go.wait()

    worker = Worker(fast(settings), handlers=handlers(hold=hold), concurrency=4)
    async with started(worker):
        first = await queue.submit("hold", {"first": True})
        await wait_until(lambda: _status_is(queue, first.task_id, "running"), 10, "it runs")
        parked_at = int(time.time() * 1000)
        second = await queue.submit("hold", {})
        await wait_until(lambda: _status_is(queue, second.task_id, "pending"), 10, "parked")
        await queue.delete_limit("solo")

        async def dropped() -> bool:
            return worker.execution.limits.empty

        await wait_until(dropped, 3, "the worker dropped the limit")  # read every second
        due = await r.zscore(keys.retry_schedule("default"), second.task_id)
        assert due is not None and due <= parked_at + 30_000 + 5_000, due
        await r.zadd(keys.retry_schedule("default"), {second.task_id: 0})
        assert (await queue.wait(second.task_id, timeout=15)).status == TaskStatus.SUCCEEDED
        assert (await queue.get(first.task_id)).status == TaskStatus.RUNNING
        go.set()
        assert (await queue.wait(first.task_id, timeout=15)).status == TaskStatus.SUCCEEDED
