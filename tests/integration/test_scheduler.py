"""The scheduler (contract section 4): leader lock, claim and promote of due tasks, stale claims,
stale workers, resilience to dropped connections. Real Redis; no worker is needed."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from dtq import Queue, TaskStatus, calls, keys
from dtq.calls import Claimed, PromoteReply
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.models import Task
from dtq.records import STALE_HEARTBEATS
from dtq.scripts import Scripts
from dtq.store import Store
from dtq.worker.outage import RedisOutage
from dtq.worker.scheduler import CLAIM_BATCH, Scheduler
from support import Events, wait_until
from support.scheduler import running

pytestmark = pytest.mark.backends("single", "cluster")

WORKER_A = "worker-aaaaaaaa"
WORKER_B = "worker-bbbbbbbb"


# -- helpers --------------------------------------------------------------------------------------


async def status_of(queue: Queue, task_id: str) -> TaskStatus:
    return (await queue.get(task_id)).status


async def make_retrying(r: Redis, queue: Queue, task_id: str, due_ms: int) -> None:
    """Put a submitted (QUEUED) task in the state finish.lua leaves after a retryable failure
    of attempt 1: entry ACKed and deleted, status RETRYING, attempt 1, due in the schedule."""
    task = await queue.get(task_id)
    assert task.entry_id is not None
    await r.xdel(keys.stream(task.queue, task.priority), task.entry_id)
    await r.hset(
        keys.task(task_id),
        mapping={"status": "retrying", "attempt": 1, "retry_delay_ms": 100, "entry_id": ""},
    )
    await r.zadd(keys.retry_schedule(task.queue), {task_id: due_ms})


@pytest.fixture
def settings(settings: Settings) -> Settings:
    fast = {"scheduler_interval_s": 0.05, "heartbeat_interval_s": 0.2, "visibility_timeout_s": 5}
    return settings.model_copy(update=fast)


@pytest.fixture
def scheduler(queue: Queue, settings: Settings) -> Scheduler:
    return Scheduler(queue.store, settings, WORKER_A)


# -- promotion ------------------------------------------------------------------------------------


async def test_delayed_task_promoted_at_its_due_time(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    async with Events(r, queues=["mail"]) as events:
        task = await queue.submit(
            "echo_task",
            {"n": 1},
            queue="mail",
            priority=7,
            delay_seconds=0.6,
            idempotency_key="k-1",
            max_attempts=3,
            timeout_ms=1234,
        )
        assert task.status is TaskStatus.PENDING
        assert (await scheduler.tick()).promoted == []  # not due yet
        async with running(scheduler):
            await wait_until(lambda: _is(queue, task.task_id, TaskStatus.QUEUED))
        await events.wait_for("TASK_QUEUED", task.task_id, count=2)

    stored = await queue.get(task.task_id)
    stream = keys.stream("mail", 7)
    entries = await r.xrange(stream)
    assert len(entries) == 1
    entry_id, fields = entries[0]
    assert stored.entry_id == entry_id
    assert fields == {
        "task_id": task.task_id,
        "queue": "mail",
        "task_type": "echo_task",
        "payload": '{"n":1}',
        "attempt": "1",
        "max_attempts": "3",
        "priority": "7",
        "timeout_ms": "1234",
        "idempotency_key": "k-1",
    }
    assert [g["name"] for g in await r.xinfo_groups(stream)] == ["workers"]
    assert await r.zcard(keys.retry_schedule("mail")) == 0
    assert await r.zcard(keys.retry_claimed("mail")) == 0

    # Promoted at its due time on the Redis clock: not before, and promptly after.
    hist = await queue.history(task.task_id)
    assert [(h.from_status, h.to_status) for h in hist] == [
        (None, TaskStatus.PENDING),
        (TaskStatus.PENDING, TaskStatus.QUEUED),
    ]
    lag = hist[-1].ts - stored.available_at
    assert timedelta(0) <= lag < timedelta(seconds=1)

    submitted, promoted = events.of("TASK_QUEUED", task.task_id)
    assert submitted.metadata.get("promoted") is None
    assert promoted.metadata["promoted"] is True
    assert promoted.metadata["next_attempt"] == 1
    assert promoted.metadata["entry_id"] == entry_id
    assert promoted.queue == "mail" and promoted.task_type == "echo_task"


async def _is(queue: Queue, task_id: str, status: TaskStatus) -> bool:
    return await status_of(queue, task_id) is status


async def test_retrying_task_promoted_as_retry_with_next_attempt(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    task = await queue.submit("flaky_task", {}, max_attempts=3)
    await make_retrying(r, queue, task.task_id, await redis_time_ms(r) - 1)
    async with Events(r) as events:
        result = await scheduler.tick()
        await events.wait_for("TASK_RETRIED", task.task_id)
    assert result.leader and result.retried == [task.task_id] and result.promoted == []
    assert result.labels == {task.task_id: ("default", "flaky_task")}  # for the metrics
    assert events.of("TASK_QUEUED", task.task_id) == []
    retried = events.of("TASK_RETRIED", task.task_id)[0]
    assert retried.attempt == 1 and retried.metadata["next_attempt"] == 2

    stored = await queue.get(task.task_id)
    assert stored.status is TaskStatus.QUEUED and stored.attempt == 1
    entries = await r.xrange(keys.stream("default", 5))
    assert len(entries) == 1
    assert entries[0][0] == stored.entry_id
    assert entries[0][1]["attempt"] == "2" and entries[0][1]["max_attempts"] == "3"
    last = (await queue.history(task.task_id))[-1]
    assert (last.from_status, last.to_status, last.attempt, last.reason) == (
        TaskStatus.RETRYING,
        TaskStatus.QUEUED,
        1,
        "retry",
    )


async def test_cancelled_task_is_not_promoted(queue: Queue, r: Redis, scheduler: Scheduler) -> None:
    # The ordinary way: cancel removes the schedule member, nothing is claimed.
    a = await queue.submit("echo_task", {}, delay_seconds=0.05)
    await queue.cancel(a.task_id)
    # A schedule member left behind for a cancelled task (e.g. written by a stale process):
    # promote sees the status and only drops the claim.
    b = await queue.submit("echo_task", {}, delay_seconds=30)
    await queue.cancel(b.task_id)
    await r.zadd(keys.retry_schedule("default"), {b.task_id: await redis_time_ms(r) - 1})
    await asyncio.sleep(0.06)
    async with Events(r) as events:
        result = await scheduler.tick()
    assert result.claimed == 1 and result.skipped == [b.task_id] and result.promoted == []
    for t in (a, b):
        assert await status_of(queue, t.task_id) is TaskStatus.CANCELLED
    assert await r.xlen(keys.stream("default", 5)) == 0
    assert await r.zcard(keys.retry_schedule("default")) == 0
    assert await r.zcard(keys.retry_claimed("default")) == 0
    assert events.items == []


async def test_promote_twice_makes_one_entry(queue: Queue, r: Redis, scheduler: Scheduler) -> None:
    """A repeated promote (two schedulers, or a retry of a lost reply) never adds an entry."""
    task = await queue.submit("echo_task", {}, delay_seconds=30)
    await r.zrem(keys.retry_schedule("default"), task.task_id)
    await r.zadd(keys.retry_claimed("default"), {task.task_id: await redis_time_ms(r)})
    todo = [(task.task_id, ("default", 5, ""))]
    first = await calls.promote_many(queue.store, todo)
    second = await calls.promote_many(queue.store, todo)
    assert first == [PromoteReply("queued", "pending")]
    assert second == [PromoteReply("skip", "not_claimed")]
    # Claimed again by mistake: the status (QUEUED) refuses it.
    await r.zadd(keys.retry_claimed("default"), {task.task_id: await redis_time_ms(r)})
    assert await calls.promote_many(queue.store, todo) == [PromoteReply("skip", "queued")]
    assert await r.xlen(keys.stream("default", 5)) == 1
    assert await r.zcard(keys.retry_claimed("default")) == 0


async def test_task_whose_hash_is_gone_is_dropped(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    await queue.store.ensure_groups("default")  # a queue in use, its hash of the task gone
    gone = calls.new_task_id("default")  # the queue's slot on a cluster
    await r.zadd(keys.retry_schedule("default"), {gone: await redis_time_ms(r) - 1})
    result = await scheduler.tick()
    assert result.skipped == [gone]
    assert await r.zcard(keys.retry_schedule("default")) == 0
    assert await r.zcard(keys.retry_claimed("default")) == 0


async def test_backlog_drains_in_one_tick(queue: Queue, r: Redis, scheduler: Scheduler) -> None:
    n = CLAIM_BATCH * 2 + 50
    tasks = await queue.submit_many(
        [{"task_type": "echo_task", "payload": {"i": i}} for i in range(n)], delay_seconds=30
    )
    now = await redis_time_ms(r)
    ids = [t.task_id for t in tasks if isinstance(t, Task)]
    assert len(ids) == n
    await r.zadd(keys.retry_schedule("default"), {tid: now - 1 for tid in ids})
    result = await scheduler.tick()
    assert result.claimed == n and len(result.promoted) == n
    assert await r.xlen(keys.stream("default", 5)) == n
    assert await r.zcard(keys.retry_schedule("default")) == 0


async def test_stale_claims_go_back_and_fresh_ones_stay(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    stale = await queue.submit("echo_task", {"c": "stale"}, delay_seconds=30)
    fresh = await queue.submit("echo_task", {"c": "fresh"}, delay_seconds=30)
    await r.zrem(keys.retry_schedule("default"), stale.task_id, fresh.task_id)
    now = await redis_time_ms(r)
    # A scheduler claimed both and died: one claim is older than DTQ_CLAIM_STALE_S (60 s).
    await r.zadd(
        keys.retry_claimed("default"), {stale.task_id: now - 61_000, fresh.task_id: now - 1_000}
    )
    result = await scheduler.tick()
    assert result.stale_claims == 1
    assert result.promoted == [stale.task_id]  # back in the schedule, due, promoted at once
    assert await status_of(queue, stale.task_id) is TaskStatus.QUEUED
    assert await status_of(queue, fresh.task_id) is TaskStatus.PENDING
    assert await r.zrange(keys.retry_claimed("default"), 0, -1) == [fresh.task_id]
    assert await r.xlen(keys.stream("default", 5)) == 1


async def test_claim_due_returns_stale_claims_to_the_schedule(queue: Queue, r: Redis) -> None:
    now = await redis_time_ms(r)
    await r.zadd(keys.retry_claimed("default"), {"old": now - 61_000, "new": now})
    await r.zadd(keys.retry_schedule("default"), {"later": now + 60_000})
    [scope] = keys.scopes(["default"])
    got = await calls.claim_due(queue.store, scope, 1, 60_000)
    assert got == Claimed(["old"], 1, got.now_ms)
    assert abs(got.now_ms - await redis_time_ms(r)) < 1000
    assert await r.zrange(keys.retry_schedule("default"), 0, -1) == ["later"]
    assert sorted(await r.zrange(keys.retry_claimed("default"), 0, -1)) == ["new", "old"]


# -- leader lock ----------------------------------------------------------------------------------


async def test_one_leader_and_takeover_after_release(queue: Queue, r: Redis) -> None:
    a = Scheduler(queue.store, queue.settings, WORKER_A)
    b = Scheduler(queue.store, queue.settings, WORKER_B)
    assert (await a.tick()).leader and a.is_leader
    assert not (await b.tick()).leader and not b.is_leader
    assert await r.get(keys.SCHEDULER_LOCK) == WORKER_A
    assert 0 < await r.pttl(keys.SCHEDULER_LOCK) <= 10_000

    # The follower cannot release or refresh the leader's lock.
    await b.release()
    assert await r.get(keys.SCHEDULER_LOCK) == WORKER_A
    assert not await calls.lock(queue.store, "refresh", WORKER_B, 10_000)

    # Only the leader works: a due task waits for it.
    task = await queue.submit("echo_task", {}, delay_seconds=0.01)
    await asyncio.sleep(0.03)
    assert (await b.tick()).promoted == []
    assert await status_of(queue, task.task_id) is TaskStatus.PENDING

    await a.release()
    assert not a.is_leader and await r.get(keys.SCHEDULER_LOCK) is None
    result = await b.tick()
    assert result.leader and result.promoted == [task.task_id]
    assert not (await a.tick()).leader


async def test_takeover_after_leader_dies(queue: Queue, r: Redis) -> None:
    a = Scheduler(queue.store, queue.settings, WORKER_A)
    b = Scheduler(queue.store, queue.settings, WORKER_B)
    assert (await a.tick()).leader
    assert not (await b.tick()).leader
    # a dies without releasing; its lock lives out its PX (shortened here from 10 s).
    await r.pexpire(keys.SCHEDULER_LOCK, 50)
    await wait_until(lambda: _lock_gone(r))
    assert (await b.tick()).leader
    assert await r.get(keys.SCHEDULER_LOCK) == WORKER_B
    # a comes back: it is no longer leader and cannot take the lock from b.
    assert not (await a.tick()).leader
    await a.release()
    assert await r.get(keys.SCHEDULER_LOCK) == WORKER_B


async def _lock_gone(r: Redis) -> bool:
    return not await r.exists(keys.SCHEDULER_LOCK)


async def test_two_running_schedulers_one_leads_then_the_other(queue: Queue, r: Redis) -> None:
    a = Scheduler(queue.store, queue.settings, WORKER_A)
    b = Scheduler(queue.store, queue.settings, WORKER_B)
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    run_a = asyncio.create_task(a.run(stop_a))
    run_b = asyncio.create_task(b.run(stop_b))
    try:

        async def someone_leads() -> bool:
            return a.is_leader or b.is_leader

        await wait_until(someone_leads)
        for _ in range(5):
            await asyncio.sleep(0.06)
            assert a.is_leader != b.is_leader
        leader, follower = (a, b) if a.is_leader else (b, a)
        stop_leader, leader_run = (stop_a, run_a) if leader is a else (stop_b, run_b)
        assert await r.get(keys.SCHEDULER_LOCK) == leader.worker_id

        stop_leader.set()
        await asyncio.wait_for(leader_run, 5)  # run() returns after releasing the lock
        assert not leader.is_leader

        async def follower_leads() -> bool:
            return follower.is_leader

        await wait_until(follower_leads, timeout_s=2)
        task = await queue.submit("echo_task", {}, delay_seconds=0.05)
        await wait_until(lambda: _is(queue, task.task_id, TaskStatus.QUEUED), timeout_s=2)
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.wait_for(asyncio.gather(run_a, run_b), 5)
    assert await r.get(keys.SCHEDULER_LOCK) is None


async def test_lock_held_by_another_owner_is_left_alone(
    queue: Queue, r: Redis, scheduler: Scheduler
) -> None:
    await r.set(keys.SCHEDULER_LOCK, "worker-cccccccc", px=10_000)
    assert not (await scheduler.tick()).leader
    await scheduler.release()
    assert await r.get(keys.SCHEDULER_LOCK) == "worker-cccccccc"


# -- stale workers --------------------------------------------------------------------------------


async def test_stale_workers_reported_once_and_removed(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    now = await redis_time_ms(r)
    interval_ms = settings.heartbeat_interval_s * 1000
    await r.sadd(keys.WORKERS, "worker-11111111", "worker-22222222", "worker-33333333")
    await r.sadd(keys.WORKERS, "worker-44444444")
    await r.hset(
        keys.worker("worker-11111111"), mapping={"last_heartbeat_ms": now, "status": "ready"}
    )
    await r.hset(
        keys.worker("worker-22222222"),
        mapping={"last_heartbeat_ms": int(now - 4 * interval_ms), "status": "busy"},
    )
    # worker-33333333: its hash expired (the process died long ago).
    await r.hset(keys.worker("worker-44444444"), mapping={"status": "starting"})  # no beat yet

    a = Scheduler(queue.store, settings, WORKER_A)
    b = Scheduler(queue.store, settings, WORKER_B)
    async with Events(r) as events:
        result = await a.tick()
        assert sorted(result.stale_workers) == ["worker-22222222", "worker-33333333"]
        await events.wait_for("WORKER_STALE", count=2)
        await a.release()
        assert (await b.tick()).stale_workers == []  # the next leader finds nothing new
        await asyncio.sleep(0.1)
    stale = events.of("WORKER_STALE")
    assert sorted(e.worker_id for e in stale) == ["worker-22222222", "worker-33333333"]
    by_id = {e.worker_id: e for e in stale}
    assert by_id["worker-22222222"].metadata["reason"] == "heartbeat_old"
    assert by_id["worker-22222222"].metadata["heartbeat_age_ms"] >= 4 * interval_ms
    assert by_id["worker-33333333"].metadata["reason"] == "hash_gone"
    assert abs(stale[0].ts.timestamp() * 1000 - now) < 2000
    assert sorted(await r.smembers(keys.WORKERS)) == ["worker-11111111", "worker-44444444"]


async def test_no_worker_is_judged_stale_right_after_an_outage_nor_itself(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """After Redis was away, every heartbeat is as old as the outage: the scheduler waits a
    stale limit (3 heartbeat intervals) before judging; and it never judges its own worker."""
    await r.sadd(keys.WORKERS, WORKER_A, "worker-66666666")  # neither has a heartbeat hash
    outage = RedisOutage()
    a = Scheduler(queue.store, settings, WORKER_A, outage=outage)
    outage.failed("poll loop", RedisConnectionError("Connection refused"))
    outage.ok("poll loop")  # Redis answers again
    assert (await a.tick()).stale_workers == []
    assert await r.sismember(keys.WORKERS, "worker-66666666")
    outage.last_failure -= STALE_HEARTBEATS * settings.heartbeat_interval_s  # the limit passed
    assert (await a.tick()).stale_workers == ["worker-66666666"]
    assert await r.sismember(keys.WORKERS, WORKER_A)  # never itself


async def test_a_live_worker_becomes_stale_when_its_heartbeat_stops(
    queue: Queue, r: Redis, settings: Settings, scheduler: Scheduler
) -> None:
    wid = "worker-55555555"
    await r.sadd(keys.WORKERS, wid)
    await r.hset(keys.worker(wid), mapping={"last_heartbeat_ms": await redis_time_ms(r)})
    async with Events(r) as events, running(scheduler):
        await asyncio.sleep(0.2)
        assert events.of("WORKER_STALE") == []
        # No more heartbeats: stale after 3 intervals (0.6 s), seen at the next check (1 s).
        await events.wait_for("WORKER_STALE")
    assert events.of("WORKER_STALE")[0].worker_id == wid
    assert not await r.sismember(keys.WORKERS, wid)


# -- transient errors -----------------------------------------------------------------------------


@pytest.mark.backends("single", reason="a plain client on a closed port, no backend at all")
async def test_unreachable_redis_is_logged_not_fatal(settings: Settings) -> None:
    from dtq.devserver import free_port

    dead = Redis.from_url(
        f"redis://127.0.0.1:{free_port()}", decode_responses=True, socket_connect_timeout=0.2
    )
    scheduler = Scheduler(Store(dead, Scripts(), settings), settings, WORKER_A)
    try:
        result = await scheduler.tick()
        assert result.errors == ["lock"] and not result.leader
        async with running(scheduler) as task:
            await asyncio.sleep(0.3)
            assert not task.done()
    finally:
        await dead.aclose()


@pytest.mark.backends("single", reason="kills one server's client connections by name")
async def test_loop_survives_killed_connections(queue: Queue, r: Redis, settings: Settings) -> None:
    client = Redis.from_url(settings.redis_url, decode_responses=True, client_name="sched-test")
    scheduler = Scheduler(Store(client, Scripts(), settings), settings, WORKER_A)
    try:
        async with running(scheduler) as loop:
            await wait_until(lambda: _leads(scheduler))
            killed = 0
            for _ in range(5):  # drop the scheduler's connections under it, repeatedly
                for c in await r.client_list():
                    if c.get("name") == "sched-test":
                        killed += await r.client_kill_filter(_id=c["id"])
                await asyncio.sleep(0.06)
            assert killed >= 3
            task = await queue.submit("echo_task", {}, delay_seconds=0.05)
            await wait_until(lambda: _is(queue, task.task_id, TaskStatus.QUEUED))
            assert not loop.done()
    finally:
        await client.aclose()


async def _leads(s: Scheduler) -> bool:
    return s.is_leader
