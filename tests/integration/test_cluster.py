"""dtq on a 3-primary Redis Cluster (the cluster layout, DTQ_REDIS_CLUSTER): every guarantee of
the single-Redis tests, with queues spread over the primaries (docs/redis-schema.md, "The
cluster layout")."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import RedisCluster

from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq.models import TaskStatus
from dtq_tasks import load_task_modules
from support import running_worker, wait_until

QUEUES = tuple(f"q{i}" for i in range(6))


@pytest.fixture
def csettings(cluster_url: str) -> Settings:
    load_task_modules(["examples.tasks"])  # the worker runs the example handlers
    return Settings(
        redis_url=cluster_url,
        redis_cluster=True,
        scheduler_interval_s=0.05,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
        retry_jitter=0,
    )


@pytest.fixture
async def cq(csettings: Settings) -> AsyncIterator[Queue]:
    q = await connect(settings=csettings)
    yield q
    await q.close()
    keys.use_layout(False)


@pytest.fixture
async def rc(cluster_url: str) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(cluster_url, decode_responses=True)
    await client.initialize()
    yield client
    await client.aclose()


async def test_queues_spread_over_the_primaries_and_each_script_touches_one_slot(
    cq: Queue, rc: RedisCluster
) -> None:
    tasks = await cq.submit_many(
        [{"task_type": "echo_task", "payload": {"i": i}, "queue": QUEUES[i % 6]} for i in range(30)]
    )
    assert all(not isinstance(t, Exception) for t in tasks)
    nodes = {rc.get_node_from_key(keys.stream(q, 5)).name for q in QUEUES}
    assert len(nodes) >= 2  # six queues' slots land on more than one primary
    for t in tasks:
        assert not isinstance(t, Exception)
        assert keys.slot(keys.task(t.task_id)) == keys.slot(keys.stream(t.queue, 5))
        assert await rc.hget(keys.task(t.task_id), "payload") is not None
    assert sorted(await rc.smembers(keys.QUEUES)) == sorted(QUEUES)
    # Found from its id alone, and listed across queues newest first.
    got = await cq.get(tasks[7].task_id)  # type: ignore[union-attr]
    assert got.queue == QUEUES[1] and got.payload == {"i": 7}
    listed = await cq.list(limit=30)
    assert {t.task_id for t in listed} == {t.task_id for t in tasks}  # type: ignore[union-attr]
    one_by_one = [await cq.submit("echo_task", {}, queue=QUEUES[i % 6]) for i in range(6)]
    newest = await cq.list(limit=6)
    assert [t.task_id for t in newest] == [t.task_id for t in reversed(one_by_one)]
    assert [t.task_id for t in await cq.list(queue="q2", limit=1)] == [one_by_one[2].task_id]


async def test_a_worker_drains_queues_on_every_primary(cq: Queue, csettings: Settings) -> None:
    tasks = [await cq.submit("echo_task", {"i": i}, queue=QUEUES[i % 6]) for i in range(24)]
    failing = await cq.submit("always_fail_task", {}, queue="q3", max_attempts=2)
    delayed = await cq.submit("echo_task", {"late": True}, queue="q4", delay_seconds=0.2)
    async with running_worker(csettings, queues=QUEUES, concurrency=8):

        async def done() -> bool:
            got = [await cq.get(t.task_id) for t in (*tasks, failing, delayed)]
            return all(t.status in {TaskStatus.SUCCEEDED, TaskStatus.DEAD_LETTERED} for t in got)

        await wait_until(done, 20, "every task terminal")
        assert (await cq.get(failing.task_id)).status is TaskStatus.DEAD_LETTERED
        assert (await cq.get(delayed.task_id)).status is TaskStatus.SUCCEEDED
        [dead] = await cq.dlq_list()
        assert dead.task_id == failing.task_id
        requeued = await cq.requeue_dead_letter(failing.task_id)
        assert requeued.status is TaskStatus.QUEUED

        async def dead_again() -> bool:
            return (await cq.get(failing.task_id)).status is TaskStatus.DEAD_LETTERED

        await wait_until(dead_again, 20, "the requeued task dead-lettered again")
    assert await cq.purge_dead_letters() == 1
    assert await cq.dlq_list() == []


async def test_operator_actions_on_a_cluster(cq: Queue) -> None:
    waiting = await cq.submit("echo_task", {}, queue="q2")
    later = await cq.submit("echo_task", {}, queue="q5", delay_seconds=3600, ttl_seconds=7200)
    assert (await cq.cancel(waiting.task_id)).status is TaskStatus.CANCELLED
    assert (await cq.mark_expired(later.task_id)).status is TaskStatus.EXPIRED
    assert await cq.pause_queue("q1") is True
    stats = {s.queue: s for s in await cq.all_queue_stats()}
    assert stats["q1"].paused and stats["q2"].depth == 0
    for i in range(3):
        await cq.submit("echo_task", {"i": i}, queue="q0")
    assert await cq.purge_queue("q0") == 3
    idem = await cq.submit("echo_task", {}, queue="q3", idempotency_key="order-1")
    from dtq.errors import IdempotencyInProgressError

    with pytest.raises(IdempotencyInProgressError):
        await cq.submit("echo_task", {}, queue="q3", idempotency_key="order-1")
    assert idem.task_id
    actions = {e.action for e in await cq.audit_log()}
    assert actions == set()  # SDK calls without an Audit write none


async def test_an_idle_queue_leaves_the_registry_unless_its_own_sets_hold_work(
    csettings: Settings, rc: RedisCluster
) -> None:
    """On a cluster the queue's schedule, claimed, expiry and cancelled sets and its dead-letter
    stream are its own: remove_queue.lua checks them itself, and the scheduler's pass takes the
    name out of dtq:queues (another slot) only around a removal that happened."""
    from dtq import calls
    from dtq.worker.idle_queues import IdleQueues

    q = await connect(settings=csettings.model_copy(update={"queue_idle_ttl_s": 1}))
    try:
        delayed = await q.submit("echo_task", {}, queue="later", delay_seconds=3600)
        dead = await q.submit("echo_task", {}, queue="dead")
        await q.submit("echo_task", {}, queue="empty")
        for t in (dead,):
            await rc.xadd(keys.dead_letter(t.queue), {"task_id": t.task_id})
        for name in ("dead", "empty"):  # drained: their entries gone, as a worker leaves them
            for stream in keys.queue_streams(name):
                await rc.xtrim(stream, maxlen=0)

        async def empty_is_idle() -> bool:
            [reply] = await calls.remove_queue(q.store, [("empty", None)])
            return not isinstance(reply, Exception) and reply.kind == "idle"

        await wait_until(empty_is_idle, 5, "the empty queue idle past its TTL")
        replies = await calls.remove_queue(q.store, [("later", None), ("dead", None)])
        assert [(r.kind, r.detail) for r in replies] == [  # type: ignore[union-attr]
            ("busy", "scheduled"),
            ("busy", "dead_letters"),
        ]
        removed: list[str] = []
        idle = IdleQueues(q.store)
        done = False
        while not done:
            got, done = await idle.step(keep=set())
            removed += got
        assert removed == ["empty"]
        assert sorted(await rc.smembers(keys.QUEUES)) == ["dead", "later"]
        assert (await q.get(delayed.task_id)).status is TaskStatus.PENDING
    finally:
        await q.close()
