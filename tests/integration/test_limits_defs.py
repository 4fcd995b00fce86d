"""Limit definitions through the SDK against a real Redis, in both key layouts (docs/limits.md):
create, update, unchanged, read with their use, list, move to another queue, delete (state
kept), audit entries and events, and the limits a starting worker syncs from code."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, calls, connect, connect_sync, keys
from dtq.admin.limits import SCAN_KEYS_MAX, sync_code_limits
from dtq.calls import Audit
from dtq.config import Settings
from dtq.errors import LimitNotFoundError
from dtq.limits import LimitDef, LimitSpecError
from dtq_tasks import task
from support import Events, wait_until
from support.worker import fast, handlers, running_worker

pytestmark = pytest.mark.backends("single", "cluster")


async def test_put_get_list_delete(queue: Queue, r: Redis) -> None:
    async with Events(r, ["payments"]) as events:
        limit, outcome = await queue.put_limit(
            "charge", queue="payments", task_type="charge", rate="100/s", burst=10,
            audit=Audit("tester"),
        )  # fmt: skip
        assert outcome == "created"
        assert (limit.name, limit.queue, limit.task_type) == ("charge", "payments", "charge")
        assert (limit.rate, limit.burst, limit.concurrency, limit.source) == (
            "100/s",
            10,
            None,
            "api",
        )
        assert (limit.use.running, limit.use.waiting, limit.use.keys) == (0, 0, None)

        again, outcome = await queue.put_limit(
            "charge", {"queue": "payments", "task_type": "charge", "rate": "100/s", "burst": 10}
        )
        assert outcome == "unchanged" and again == limit
        changed, outcome = await queue.put_limit(
            "charge", queue="payments", task_type="charge", concurrency=20
        )
        assert outcome == "updated"
        assert (changed.rate, changed.burst, changed.concurrency) == (None, None, 20)
    changes = [e.metadata for e in events.of("CONFIGURATION_CHANGED")]
    assert changes == [
        {"limit": "charge", "change": "created"},
        {"limit": "charge", "change": "updated"},
    ]

    assert await queue.get_limit("charge") == changed
    await queue.put_limit("default-rate", rate="5/m")
    assert [x.name for x in await queue.list_limits()] == ["charge", "default-rate"]
    assert (await queue.get_limit("default-rate")).queue == "default"

    await queue.delete_limit("charge", audit=Audit("tester"))
    with pytest.raises(LimitNotFoundError):
        await queue.get_limit("charge")
    with pytest.raises(LimitNotFoundError):
        await queue.delete_limit("charge")
    assert [x.name for x in await queue.list_limits()] == ["default-rate"]

    entries = [(e.action, e.limit, e.queue, e.actor) for e in await queue.audit_log(10)]
    assert entries[:2] == [
        ("limit_delete", "charge", "payments", "tester"),
        ("limit_put", "charge", "payments", "tester"),
    ]


async def test_bad_definitions_are_refused_and_nothing_is_stored(queue: Queue, r: Redis) -> None:
    for fields, words in [
        ({}, "a rate, a concurrency"),
        ({"rate": "fast"}, "COUNT/PERIOD"),
        ({"concurrency": 0}, "concurrency"),
        ({"burst": 3, "concurrency": 2}, "burst needs a rate"),
        ({"rate": "1/s", "key": "tenant"}, "payload path"),
        ({"rate": "1/s", "queue": "Bad Queue"}, "queue"),
        ({"rate": "1/s", "colour": "red"}, "colour"),
    ]:
        with pytest.raises(LimitSpecError, match=words) as info:
            await queue.put_limit("bad", fields)
        assert info.value.code == "INVALID_LIMIT"
    with pytest.raises(LimitSpecError, match="limit name"):
        await queue.put_limit("no spaces", rate="1/s")
    assert await queue.list_limits() == []
    assert await r.exists(keys.limits("default")) == 0


async def test_use_is_read_from_the_state_keys(queue: Queue, r: Redis) -> None:
    """The state is the start and finish scripts'; here it is written by hand as they do."""
    await queue.put_limit("db", queue="jobs", concurrency=5)
    await queue.put_limit("tenants", queue="jobs", key="payload.tenant", rate="10/s", concurrency=2)
    prefix = keys.limit_state("jobs", "db")
    await r.zadd(prefix + ":running", {"t1": 1, "t2": 2, "t3": 3})
    await r.zadd(prefix + ":waiting", {"t4": 4})
    for value, running, waiting in [("acme", 2, 3), ("a:b", 1, 0), ("idle", 0, 0)]:
        p = keys.limit_state("jobs", "tenants", value)
        await r.hset(p + ":rate", "tat", 1)
        if running:
            await r.zadd(p + ":running", {f"{value}-r{i}": i for i in range(running)})
        if waiting:
            await r.zadd(p + ":waiting", {f"{value}-w{i}": i for i in range(waiting)})

    db = await queue.get_limit("db")
    assert (db.use.running, db.use.waiting, db.use.keys) == (3, 1, None)
    tenants = await queue.get_limit("tenants")
    assert (tenants.use.running, tenants.use.waiting, tenants.use.keys) == (3, 3, 3)
    assert not tenants.use.capped
    assert {x.name: x.use for x in await queue.list_limits()} == {
        "db": db.use,
        "tenants": tenants.use,
    }
    assert SCAN_KEYS_MAX >= 1000

    await queue.delete_limit("db")  # with its state: a limit made again starts clean
    assert await r.exists(prefix + ":running", prefix + ":waiting") == 0


async def test_a_limit_moved_to_another_queue_is_found_there_only(queue: Queue, r: Redis) -> None:
    await queue.put_limit("mover", queue="alpha", rate="1/s")
    moved, outcome = await queue.put_limit("mover", queue="beta", rate="1/s")
    assert outcome == "updated" and moved.queue == "beta"
    assert (await queue.get_limit("mover")).queue == "beta"
    assert [(x.name, x.queue) for x in await queue.list_limits()] == [("mover", "beta")]
    assert await r.hget(keys.limits("beta"), "mover") is not None
    if keys.cluster_layout():
        assert await r.hget(keys.limits("alpha"), "mover") is None
    assert "beta" in await r.smembers(keys.QUEUES)  # where workers and the lookup find it


async def test_code_limits_sync(queue: Queue) -> None:
    store = queue.store
    audit = Audit("worker:w1")
    charge = LimitDef(task_type="charge", rate="100/s", concurrency=20, source="code")
    other = LimitDef(task_type="other", concurrency=1, source="code")
    outcomes, deleted = await sync_code_limits(
        store, {"charge": charge, "other": other}, {"charge"}, audit=audit
    )
    assert (outcomes, deleted) == ({"charge": "created"}, [])  # "other" is not this worker's
    assert (await queue.get_limit("charge")).source == "code"
    await queue.put_limit("manual", task_type="charge", rate="1/s")  # from the API: kept

    outcomes, deleted = await sync_code_limits(store, {"charge": charge}, {"charge"}, audit=audit)
    assert (outcomes, deleted) == ({"charge": "unchanged"}, [])
    outcomes, deleted = await sync_code_limits(store, {}, {"other"}, audit=audit)
    assert (outcomes, deleted) == ({}, [])  # a worker without the handler leaves it
    outcomes, deleted = await sync_code_limits(store, {}, {"charge"}, audit=audit)
    assert (outcomes, deleted) == ({}, ["charge"])
    assert [x.name for x in await queue.list_limits()] == ["manual"]
    actions = [(e.action, e.limit, e.actor) for e in await queue.audit_log(10)]
    assert actions[0] == ("limit_delete", "charge", "worker:w1")


async def test_a_starting_worker_puts_its_code_limits_and_drops_the_removed_ones(
    queue: Queue, settings: Settings
) -> None:
    registry = importlib.import_module("dtq_tasks.registry")  # the module, not the function
    saved = dict(registry._LIMITS)
    try:
        task("limits-test.charge", rate_limit="50/s", concurrency=3)(_noop)
        await queue.put_limit(  # declared by an older deploy of the same handlers
            "limits-test.old",
            LimitDef(task_type="limits-test.charge", concurrency=1, source="code"),
        )
        await queue.put_limit("limits-test.ops", task_type="limits-test.charge", rate="1/s")
        async with running_worker(fast(settings), handlers(**{"limits-test.charge": _noop})):
            pass
    finally:
        registry._LIMITS.clear()
        registry._LIMITS.update(saved)
        registry._REGISTRY.pop("limits-test.charge", None)
    got = {x.name: x for x in await queue.list_limits()}
    assert sorted(got) == ["limits-test.charge", "limits-test.ops"]
    assert got["limits-test.charge"].definition == LimitDef(
        task_type="limits-test.charge", rate="50/s", concurrency=3, source="code"
    )
    actors = {(e.action, e.limit): e.actor for e in await queue.audit_log(10)}
    assert actors[("limit_put", "limits-test.charge")].startswith("worker:")
    assert actors[("limit_delete", "limits-test.old")].startswith("worker:")


def _noop(payload: dict[str, Any], ctx: Any) -> None:
    return None


@pytest.mark.backends("cluster", reason="the flat layout keeps every definition in one hash")
async def test_an_idle_queue_with_a_limit_stays_listed(settings: Settings, r: Redis) -> None:
    """A limit is found by its name through dtq:queues: its queue is not removed as idle."""
    q = await connect(settings=settings.model_copy(update={"queue_idle_ttl_s": 1}))
    try:
        await q.put_limit("kept", queue="quiet", concurrency=1)
        await q.submit("echo_task", {}, queue="plain")
        await q.submit("echo_task", {}, queue="quiet")
        for name in ("plain", "quiet"):  # drained: their entries gone, as a worker leaves them
            for stream in keys.queue_streams(name):
                await r.xtrim(stream, maxlen=0)

        async def plain_is_idle() -> bool:
            [reply] = await calls.remove_queue(q.store, [("plain", None)])
            return not isinstance(reply, Exception) and reply.kind == "idle"

        await wait_until(plain_is_idle, 5, "the plain queue idle past its TTL")
        [reply] = await calls.remove_queue(q.store, [("quiet", None)])
        assert not isinstance(reply, Exception) and (reply.kind, reply.detail) == ("busy", "limits")
        assert (await q.get_limit("kept")).queue == "quiet"
    finally:
        await q.close()


def test_the_sync_queue_has_the_limit_methods(settings: Settings) -> None:
    with connect_sync(settings=settings) as q:
        limit, outcome = q.put_limit("sync-limit", concurrency=2, audit=Audit("tester"))
        assert outcome == "created" and limit.concurrency == 2
        assert q.get_limit("sync-limit") == limit
        assert [x.name for x in q.list_limits()] == ["sync-limit"]
        q.delete_limit("sync-limit")
        with pytest.raises(LimitNotFoundError):
            q.get_limit("sync-limit")
