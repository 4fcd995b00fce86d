"""Queue names are not unbounded state (DESIGN 11; docs/redis-schema.md, "Queue lifetime").

A queue whose streams are empty, with nothing delayed, retrying or in flight and no submit for
``DTQ_QUEUE_IDLE_TTL_S``, is removed by the scheduler leader: its ten streams (and their group),
its last-submit time and its ``dtq:queues`` member; a paused flag stays. ``default`` and the
queues of live workers are never removed. A submit, or a worker, that meets a removed queue
creates it again. ``dtq:cancelled`` members whose entry is gone are removed too.

The tests wait on the Redis clock: "idle for the TTL" is judged there. A test that a queue is
*not* removed submits to a control queue after setting the tested queue up, waits until the
control queue has been idle for the TTL, and runs one tick of a fresh scheduler (its first tick
always makes the pass): the control queue gone proves the pass ran after the tested queue's TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis

from dtq import Queue, calls, connect, keys
from dtq.calls import Outcome
from dtq.config import Settings
from dtq.worker.consumers import drop_own
from dtq.worker.idle_queues import IdleQueues, clean_cancelled
from dtq.worker.scheduler import Scheduler
from support import running_worker
from support.worker import fast, finish_as, handlers, read_as, start_as, wait_status

TTL_S = 1
CONTROL = "control"


@pytest.fixture
def idle_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"queue_idle_ttl_s": TTL_S})


@pytest.fixture
async def q(idle_settings: Settings) -> AsyncIterator[Queue]:
    client = await connect(settings=idle_settings)
    yield client
    await client.close()


async def redis_ms(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def until_redis_ms(r: Redis, target_ms: int, within_s: float = 10.0) -> None:
    """Wait until the Redis clock reaches ``target_ms`` (a deadline on the local clock too)."""
    deadline = time.monotonic() + within_s
    while await redis_ms(r) < target_ms:
        if time.monotonic() > deadline:
            raise AssertionError(f"the Redis clock did not reach {target_ms} in {within_s} s")
        await asyncio.sleep(0.02)


async def queue_keys(r: Redis, queue: str) -> dict[str, bool]:
    """Which of the queue's keys exist (streams as one "streams": any of the ten)."""
    pipe = r.pipeline(transaction=False)
    pipe.sismember(keys.QUEUES, queue)
    pipe.exists(*keys.queue_streams(queue))
    pipe.exists(keys.queue_last_submit(queue))
    pipe.exists(keys.queue_paused(queue))
    listed, streams, last, paused = await pipe.execute()
    return {
        "listed": bool(listed),
        "streams": streams > 0,
        "last": bool(last),
        "paused": paused > 0,
    }


async def gone(r: Redis, queue: str) -> bool:
    state = await queue_keys(r, queue)
    return not (state["listed"] or state["streams"] or state["last"])


async def one_pass(q: Queue, settings: Settings) -> None:
    """One tick of a fresh scheduler (it takes the lock; its first tick runs the queue pass)."""
    result = await Scheduler(q.store, settings, "leader-test").tick()
    assert result.leader and not result.errors, result


async def submit_control(q: Queue) -> int:
    """A submit to the control queue (expired at once: it leaves only the queue's own keys);
    returns its Redis time."""
    await q.submit("echo_task", queue=CONTROL, ttl_seconds=0)
    return int(await q.store.redis.get(keys.queue_last_submit(CONTROL)))


async def after_idle_pass(q: Queue, settings: Settings) -> None:
    """Submit to the control queue, wait until it is idle for the TTL, make one pass and check
    that the pass removed it (so every queue set up before it was judged after its TTL)."""
    r = q.store.redis
    at_ms = await submit_control(q)
    await until_redis_ms(r, at_ms + TTL_S * 1000)
    await one_pass(q, settings)
    assert await gone(r, CONTROL), await queue_keys(r, CONTROL)


async def ticks_until(
    scheduler: Scheduler, done: Callable[[], Awaitable[bool]], r: Redis, deadline_ms: int
) -> int:
    """Tick ``scheduler`` until ``done``; fails once the Redis clock passes ``deadline_ms``.
    Returns the Redis time at which ``done`` was seen."""
    while True:
        await scheduler.tick()
        now = await redis_ms(r)
        if await done():
            return now
        if now > deadline_ms:
            raise AssertionError("not done by the deadline on the Redis clock")
        await asyncio.sleep(0.05)


# -- removed ------------------------------------------------------------------------------------


async def test_an_idle_queue_is_removed_after_the_ttl(q: Queue, idle_settings: Settings) -> None:
    r = q.store.redis
    task = await q.submit("echo_task", queue="short-lived")
    await q.cancel(task.task_id)  # its entry goes; the streams and their group stay, empty
    state = await queue_keys(r, "short-lived")
    assert state["listed"] and state["streams"] and state["last"], state
    submitted_ms = int(await r.get(keys.queue_last_submit("short-lived")))

    scheduler = Scheduler(q.store, idle_settings, "leader-test")
    # A pass before the TTL leaves it; the one after the TTL (a pass a second) removes it.
    await scheduler.tick()
    assert not await gone(r, "short-lived")
    ttl_ms = TTL_S * 1000

    async def removed() -> bool:
        return await gone(r, "short-lived")

    seen_ms = await ticks_until(scheduler, removed, r, submitted_ms + ttl_ms + 3_000)
    assert seen_ms >= submitted_ms + ttl_ms
    assert await r.xlen(keys.stream("short-lived", 5)) == 0
    assert (await q.get(task.task_id)).status.value == "cancelled"  # tasks are not touched


async def test_the_paused_flag_survives_until_resumed(q: Queue, idle_settings: Settings) -> None:
    r = q.store.redis
    await q.submit("echo_task", queue="halted", ttl_seconds=0)
    await q.pause_queue("halted")
    await after_idle_pass(q, idle_settings)
    assert await queue_keys(r, "halted") == {
        "listed": False,
        "streams": False,
        "last": False,
        "paused": True,
    }
    await q.resume_queue("halted")
    assert not await r.exists(keys.queue_paused("halted"))


# -- kept ---------------------------------------------------------------------------------------


async def test_a_queue_with_a_delayed_task_is_kept(q: Queue, idle_settings: Settings) -> None:
    task = await q.submit("echo_task", queue="later", delay_seconds=3600)
    await after_idle_pass(q, idle_settings)
    assert (await queue_keys(q.store.redis, "later"))["listed"]
    assert (await q.get(task.task_id)).status.value == "pending"


async def test_a_queue_with_a_claimed_task_is_kept(q: Queue, idle_settings: Settings) -> None:
    """A delayed task the scheduler has claimed but not promoted yet is in dtq:retry:claimed."""
    r = q.store.redis
    task = await q.submit("echo_task", queue="claimed", delay_seconds=3600)
    await r.zrem(keys.RETRY_SCHEDULE, task.task_id)
    await r.zadd(keys.RETRY_CLAIMED, {task.task_id: await redis_ms(r)})
    await after_idle_pass(q, idle_settings)
    assert (await queue_keys(r, "claimed"))["listed"]


async def test_a_queue_with_a_retrying_task_is_kept(q: Queue, idle_settings: Settings) -> None:
    r = q.store.redis
    task = await q.submit("echo_task", queue="again")
    entry = await read_as(r, "ghost", "again")
    started = await start_as(r, entry, "ghost", idle_settings)
    assert started.kind == "run"
    retry = Outcome("error", error_class="Boom", retryable=True, delay_ms=3_600_000)
    assert (await finish_as(r, entry, 1, retry, "ghost", idle_settings)).status == "retrying"
    assert await r.xlen(entry.stream) == 0  # only the schedule holds it now
    await after_idle_pass(q, idle_settings)
    assert (await queue_keys(r, "again"))["streams"]
    assert (await q.get(task.task_id)).status.value == "retrying"


async def test_a_queue_with_a_running_task_is_kept(q: Queue, idle_settings: Settings) -> None:
    """Running on a consumer with no worker hash: only the queue's own keys say it is busy."""
    r = q.store.redis
    await q.submit("echo_task", queue="busy")
    entry = await read_as(r, "ghost", "busy")
    assert (await start_as(r, entry, "ghost", idle_settings)).kind == "run"
    await after_idle_pass(q, idle_settings)
    assert (await queue_keys(r, "busy"))["streams"]
    assert (await r.xpending(entry.stream, keys.CONSUMER_GROUP))["pending"] == 1


async def test_a_queue_with_a_pending_entry_of_a_deleted_task_is_kept(
    q: Queue, idle_settings: Settings
) -> None:
    """An entry deleted while delivered (XDEL by hand) is still in the pending list."""
    r = q.store.redis
    await q.submit("echo_task", queue="held")
    entry = await read_as(r, "ghost", "held")
    await r.xdel(entry.stream, entry.entry_id)
    await after_idle_pass(q, idle_settings)
    assert (await queue_keys(r, "held"))["streams"]


async def test_a_queue_with_a_waiting_entry_is_kept(q: Queue, idle_settings: Settings) -> None:
    task = await q.submit("echo_task", queue="backlog")
    await after_idle_pass(q, idle_settings)
    assert await q.store.redis.xlen(keys.stream("backlog", task.priority)) == 1


@pytest.mark.parametrize("how", ["expired_at_submit", "ran"])
async def test_a_queue_with_a_recent_submit_is_kept(
    q: Queue, idle_settings: Settings, how: str
) -> None:
    """Submitted within the TTL: a task that left nothing (expired at submit), or one that ran
    and whose entry is gone."""
    r = q.store.redis
    at_ms = await submit_control(q)
    await until_redis_ms(r, at_ms + TTL_S * 1000)
    if how == "ran":
        await q.submit("echo_task", queue="fresh")
        entry = await read_as(r, "ghost", "fresh")
        await start_as(r, entry, "ghost", idle_settings)
        assert (
            await finish_as(r, entry, 1, Outcome("success"), "ghost", idle_settings)
        ).status == "succeeded"
    else:
        await q.submit("echo_task", queue="fresh", ttl_seconds=0)
    await one_pass(q, idle_settings)  # at once: the submit is well within the TTL
    assert await gone(r, CONTROL)
    assert (await queue_keys(r, "fresh"))["listed"]


async def test_default_is_never_removed(q: Queue, idle_settings: Settings) -> None:
    await q.submit("echo_task", ttl_seconds=0)
    await after_idle_pass(q, idle_settings)
    assert (await queue_keys(q.store.redis, "default"))["listed"]
    # The script refuses it on its own too.
    [reply] = await calls.remove_queue(q.store, [("default", None)])
    assert reply == calls.RemoveQueueReply("busy", "default")


async def test_a_queue_a_live_worker_serves_is_kept(q: Queue, idle_settings: Settings) -> None:
    """The worker's own scheduler is the leader here; the control queue shows it made a pass
    after the TTL of the idle queue its worker serves."""
    r = q.store.redis
    await q.submit("echo_task", queue="served", ttl_seconds=0)
    async with running_worker(
        fast(idle_settings), handlers(echo_task=lambda p, c: p), queues=("served",)
    ):
        at_ms = await submit_control(q)

        async def control_gone() -> bool:
            return await gone(r, CONTROL)

        deadline = time.monotonic() + 10
        while not await control_gone():
            assert time.monotonic() < deadline, "the worker's scheduler removed nothing"
            await asyncio.sleep(0.05)
        assert await redis_ms(r) >= at_ms + TTL_S * 1000
        assert (await queue_keys(r, "served"))["listed"]
    # Once its worker is gone, the queue goes too.
    await after_idle_pass(q, idle_settings)
    assert await gone(r, "served")


async def test_a_change_between_check_and_removal_refuses(q: Queue) -> None:
    """The removal needs the activity mark of its check: anything written to the queue's keys
    in between refuses it, however long the leader took (here: old enough to pass the TTL)."""
    r = q.store.redis
    await q.submit("echo_task", queue="moving", ttl_seconds=0)
    await r.set(keys.queue_last_submit("moving"), 1)  # an activity long past
    [check] = await calls.remove_queue(q.store, [("moving", None)])
    assert check.kind == "idle"
    await r.set(keys.queue_last_submit("moving"), 2)  # still long past, but not the same
    [refused] = await calls.remove_queue(q.store, [("moving", check.detail)])
    assert refused == calls.RemoveQueueReply("busy", "changed")
    await r.xadd(keys.stream("moving", 3), {"x": "1"}, id="5-0")  # an entry, long past
    await r.xdel(keys.stream("moving", 3), "5-0")
    [check] = await calls.remove_queue(q.store, [("moving", None)])
    await r.xadd(keys.stream("moving", 3), {"x": "1"}, id="6-0")
    await r.xdel(keys.stream("moving", 3), "6-0")
    [refused] = await calls.remove_queue(q.store, [("moving", check.detail)])
    assert refused == calls.RemoveQueueReply("busy", "changed")
    [check] = await calls.remove_queue(q.store, [("moving", None)])
    [removed] = await calls.remove_queue(q.store, [("moving", check.detail)])
    assert removed == calls.RemoveQueueReply("removed")
    assert await gone(r, "moving")


# -- created again ------------------------------------------------------------------------------


async def test_a_submit_to_a_removed_queue_runs(q: Queue, idle_settings: Settings) -> None:
    r = q.store.redis
    echo = handlers(echo_task=lambda p, c: p)
    first = await q.submit("echo_task", {"n": 1}, queue="revived")
    async with running_worker(fast(idle_settings), echo, queues=("revived",)):
        await wait_status(r, first.task_id, "succeeded")
    await after_idle_pass(q, idle_settings)
    assert await gone(r, "revived")

    again = await q.submit("echo_task", {"n": 2}, queue="revived", priority=2)
    for stream in keys.queue_streams("revived"):  # the group on all ten, not only on p2
        assert [g["name"] for g in await r.xinfo_groups(stream)] == [keys.CONSUMER_GROUP]
    async with running_worker(fast(idle_settings), echo, queues=("revived",)):
        done = await wait_status(r, again.task_id, "succeeded")
    assert done["queue"] == "revived"
    assert (await queue_keys(r, "revived"))["listed"]


@pytest.mark.parametrize("concurrency", [4, 16])
async def test_a_worker_that_meets_a_removed_queue_creates_it_again(
    q: Queue, idle_settings: Settings, concurrency: int
) -> None:
    """Removed under a live worker (as if the leader had judged before the worker's first
    heartbeat): its next read meets NOGROUP, creates the groups and goes on. With fewer slots
    than streams an idle worker watches them with XREAD BLOCK; with more, it waits in
    XREADGROUP BLOCK on them, which Redis 7.2 and Valkey end with an error when the stream is
    deleted."""
    r = q.store.redis
    async with running_worker(
        fast(idle_settings),
        handlers(echo_task=lambda p, c: p),
        queues=("orphaned",),
        concurrency=concurrency,
    ):
        assert (await queue_keys(r, "orphaned"))["listed"]  # the worker listed its queue
        removed, done = await IdleQueues(q.store).step(set())  # not told what is served
        assert (removed, done) == (["orphaned"], True)

        async def recreated() -> bool:
            return bool(await r.exists(*keys.queue_streams("orphaned")) == 10)

        deadline = time.monotonic() + 10
        while not await recreated():
            assert time.monotonic() < deadline, "the worker did not create the streams again"
            await asyncio.sleep(0.05)
        task = await q.submit("echo_task", queue="orphaned")
        await wait_status(r, task.task_id, "succeeded")


async def test_a_worker_leaving_a_removed_queue_stops_cleanly(q: Queue) -> None:
    """At graceful stop a worker deletes its consumers; streams already gone hold nothing."""
    assert await drop_own(q.store, "leaver", ["never-there"]) == []


# -- bounded ------------------------------------------------------------------------------------


async def test_a_flood_of_queue_names_leaves_no_keys(q: Queue, idle_settings: Settings) -> None:
    r = q.store.redis
    names = [f"flood-{i}" for i in range(600)]  # more than one page of the registry
    tasks = await q.submit_many([{"task_type": "echo_task", "queue": n} for n in names])
    for task in tasks[:300]:
        await q.cancel(task.task_id)
    async with running_worker(
        fast(idle_settings), handlers(echo_task=lambda p, c: p), queues=tuple(names[300:320])
    ):
        for task in tasks[300:320]:
            await wait_status(r, task.task_id, "succeeded")
    await q.submit("echo_task", queue="last-flood", ttl_seconds=0)
    last_ms = int(await r.get(keys.queue_last_submit("last-flood")))
    scheduler = Scheduler(q.store, idle_settings, "leader-test")

    async def all_gone() -> bool:
        left = 0
        async for _ in r.scan_iter(match="dtq:*flood-*", count=1000):
            left += 1
        return left == 0 and not await r.smembers(keys.QUEUES) & {*names, "last-flood"}

    for task in tasks[320:]:  # those never run: their entries go, their streams stay
        await q.cancel(task.task_id)
    await ticks_until(scheduler, all_gone, r, last_ms + TTL_S * 1000 + 15_000)
    assert await r.smembers(keys.QUEUES) == set()


# -- dtq:cancelled ------------------------------------------------------------------------------


async def test_cancelled_members_of_entries_gone_are_removed(
    q: Queue, idle_settings: Settings
) -> None:
    """Cancelled after delivery, before its start: the id waits in dtq:cancelled for the start
    script. When the entry is gone without a start (a hand-made XDEL, a purge of an orphan) or
    the hash has expired, nothing else would remove it."""
    r = q.store.redis
    ids = []
    for _ in range(3):
        await q.submit("echo_task", queue="dropped")
        entry = await read_as(r, "ghost", "dropped")
        await q.cancel(entry.task_id)
        ids.append((entry.task_id, entry))
    assert await r.smembers(keys.CANCELLED) == {tid for tid, _ in ids}
    (kept, _), (_, entry), (expired, _) = ids
    await r.xdel(entry.stream, entry.entry_id)
    await r.delete(keys.task(expired))
    assert await clean_cancelled(q.store) == 2
    assert await r.smembers(keys.CANCELLED) == {kept}

    # The leader does it at the end of each pass over the registry.
    await r.xdel(ids[0][1].stream, ids[0][1].entry_id)
    await one_pass(q, idle_settings)
    assert await r.smembers(keys.CANCELLED) == set()
