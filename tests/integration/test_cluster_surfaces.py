"""The API's surfaces on a 3-primary Redis Cluster (the cluster layout, DTQ_REDIS_CLUSTER): the
WebSocket events of tasks in queues on different primaries (by sharded pub/sub where the server
has it, Redis or Valkey 7.0 and later; by the classic ``dtq:events`` on Redis 6.2), the metrics
gauges, the queue list, the reads the dashboard makes, a task found by id alone, the lists
across queues and the audit log; the event hub across a failover of the primary it listens on
(docs/redis-schema.md, "Events" and "The cluster layout")."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from redis.asyncio import RedisCluster
from redis.exceptions import RedisError
from websockets.asyncio.client import connect as ws_connect

from dtq import connect, keys
from dtq.api.deps import ApiState
from dtq.api.ws import EventFilter, EventHub
from dtq.config import Settings
from dtq.devcluster import start_cluster
from dtq.errors import RedisUnavailableError
from support import running_worker, wait_until
from support.api import (
    API_KEY,
    ApiServer,
    api_server,
    api_settings,
    recv_until,
    running_api,
)
from support.events import Events

QUEUES = tuple(f"q{i}" for i in range(6))
TASK_EVENTS = ("TASK_QUEUED", "TASK_STARTED", "TASK_SUCCEEDED")


@pytest.fixture
def csettings(cluster_url: str) -> Settings:
    base = Settings(redis_url=cluster_url, redis_cluster=True, api_key=API_KEY)
    return api_settings(base, scheduler_interval_s=0.05)


@pytest.fixture
async def rc(cluster_url: str) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(cluster_url, decode_responses=True)
    await client.initialize()
    yield client
    await client.aclose()


def has_sharded_pubsub(rc: RedisCluster) -> bool:
    """Whether the cluster's server has SPUBLISH (Redis 7.0 and later, and Valkey): tried on
    the node of the channel's slot, to a channel nobody follows."""
    node = rc.get_node_from_key("probe")
    with sync_redis.Redis(host=node.host, port=node.port) as one:
        try:
            one.execute_command("SPUBLISH", "probe", "x")
        except sync_redis.ResponseError:
            return False
    return True


def shard_channels(rc: RedisCluster) -> dict[str, set[str]]:
    """PUBSUB SHARDCHANNELS of each primary, by node name."""
    out: dict[str, set[str]] = {}
    for node in rc.get_primaries():
        with sync_redis.Redis(host=node.host, port=node.port, decode_responses=True) as one:
            out[node.name] = set(one.execute_command("PUBSUB", "SHARDCHANNELS"))
    return out


def node_of(rc: RedisCluster, key: str) -> str:
    node = rc.get_node_from_key(key)
    assert node is not None
    return node.name


def hub_of(server: ApiServer) -> EventHub:
    state: ApiState = server.app.state.dtq
    assert state.hub is not None
    return state.hub


def succeeded(task_ids: set[str]) -> Callable[[list[dict[str, Any]]], bool]:
    def done(events: list[dict[str, Any]]) -> bool:
        return task_ids <= {e["task_id"] for e in events if e["type"] == "TASK_SUCCEEDED"}

    return done


async def test_websocket_events_of_queues_on_every_primary(
    csettings: Settings, rc: RedisCluster
) -> None:
    sharded = has_sharded_pubsub(rc)
    q = await connect(settings=csettings)
    try:
        assert keys.sharded_events() is sharded
        for name in QUEUES:  # registered before the API starts: subscribed at its start
            await q.submit("api_echo", {"seed": True}, queue=name, delay_seconds=3600)
        async with (
            api_server(csettings) as srv,
            ws_connect(f"ws://127.0.0.1:{srv.port}/ws/events") as every,
            ws_connect(f"ws://127.0.0.1:{srv.port}/ws/events?queue=fresh") as fresh_only,
        ):
            if sharded:  # the hub's subscriptions (the only subscriber so far)
                on_nodes = shard_channels(rc)
                for name in (*QUEUES, "default", "fresh"):
                    where = node_of(rc, keys.events(name))
                    assert keys.events(name) in on_nodes[where], (name, on_nodes)
                assert len([p for p, chans in on_nodes.items() if chans]) >= 2
            async with (
                Events(rc, queues=()) as classic,  # dtq:events alone
                Events(rc, queues=(*QUEUES, "fresh")) as collected,
            ):
                tasks = [
                    await q.submit("api_echo", {"i": i}, queue=QUEUES[i % 6]) for i in range(12)
                ]
                # A queue not registered yet: the filtered client asked the hub for it.
                fresh = await q.submit("api_echo", {"fresh": True}, queue="fresh")
                async with running_worker(csettings, queues=(*QUEUES, "fresh"), concurrency=4):
                    ids = {t.task_id for t in tasks} | {fresh.task_id}
                    seen = await recv_until(every, succeeded(ids - {fresh.task_id}))
                    seen_fresh = await recv_until(fresh_only, succeeded({fresh.task_id}))
            for t in tasks:
                mine = [e["type"] for e in seen if e["task_id"] == t.task_id]
                assert mine == list(TASK_EVENTS), (t.queue, mine)
                assert all(e["queue"] == t.queue for e in seen if e["task_id"] == t.task_id)
            assert [e["type"] for e in seen_fresh] == list(TASK_EVENTS)
            assert hub_of(srv).stats.events >= len(seen)
        for t in (*tasks, fresh):  # the tests' collector follows the queues it is told
            assert [e.type for e in collected.items if e.task_id == t.task_id] == list(TASK_EVENTS)
        # Sharded: the classic channel carries the worker events only; else every event.
        task_events = {e.task_id for e in classic.items if e.type.startswith("TASK_")}
        assert task_events & ids == (set() if sharded else ids)
        assert {"WORKER_STARTED", "WORKER_STOPPED"} <= {e.type for e in classic.items}
    finally:
        await q.close()


async def test_a_new_queue_is_followed_within_the_refresh(
    csettings: Settings, rc: RedisCluster
) -> None:
    if not has_sharded_pubsub(rc):
        pytest.skip("sharded pub/sub needs Redis or Valkey 7.0 and later")
    async with (
        api_server(csettings) as srv,
        ws_connect(f"ws://127.0.0.1:{srv.port}/ws/events") as ws,
    ):
        q = await connect(settings=csettings)
        try:
            await q.submit("api_echo", {}, queue="late")  # registers it; this event may be missed
            channel = keys.events("late")
            where = node_of(rc, channel)

            async def followed() -> bool:
                return channel in shard_channels(rc)[where]

            await wait_until(followed, 5, "the hub subscribed to the new queue's channel")
            t = await q.submit("api_echo", {"n": 2}, queue="late")
            got = await recv_until(ws, lambda evs: any(e["task_id"] == t.task_id for e in evs))
            assert got[-1]["type"] == "TASK_QUEUED" and got[-1]["queue"] == "late"
        finally:
            await q.close()


def gauge(text: str, name: str, queue: str | None = None) -> float:
    label = f'{{queue="{queue}"}}' if queue is not None else ""
    for line in text.splitlines():
        if line.startswith(f"{name}{label} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{label} not in the scrape")


async def test_metrics_queues_and_operator_reads_across_primaries(csettings: Settings) -> None:
    async with running_api(csettings) as api:
        http = api.client
        submitted = [await api.submit(queue=QUEUES[i % 6], payload={"i": i}) for i in range(12)]
        delayed = [await api.submit(queue=name, delay_seconds=3600) for name in QUEUES[:3]]
        dead = await api.submit(task_type="api_fail", queue="q4", max_attempts=1)
        async with running_worker(csettings, queues=("q4",)) as worker:

            async def dead_lettered() -> bool:
                resp = await http.get(f"/api/v1/tasks/{dead['task_id']}")
                return bool(resp.json()["status"] == "dead_lettered")

            await wait_until(dead_lettered, 15, "the failing task dead-lettered")
            workers = (await http.get("/api/v1/workers")).json()["workers"]
            assert [w["worker_id"] for w in workers] == [worker.worker_id]
            one_worker = (await http.get(f"/api/v1/workers/{worker.worker_id}")).json()
            assert one_worker["queues"] == ["q4"]
        # The first scrape already counts every queue's schedule and dead letters.
        text = (await http.get("/metrics")).text
        assert gauge(text, "dtq_retry_scheduled") == 3
        assert gauge(text, "dtq_dlq_depth") == 1
        for i, name in enumerate(QUEUES):
            waiting = 2 if name != "q4" else 0  # q4's worker drained it
            assert gauge(text, "dtq_queue_depth", name) == waiting, (i, name)

        listed = {s["queue"]: s for s in (await http.get("/api/v1/queues")).json()["queues"]}
        assert set(QUEUES) <= set(listed)
        assert [listed[n]["retry_scheduled"] for n in QUEUES] == [1, 1, 1, 0, 0, 0]
        assert listed["q1"]["depth"] == 2 and listed["q4"]["depth"] == 0
        one = (await http.get("/api/v1/queues/q4")).json()
        assert one["dlq_depth"] == 1

        # By id alone, whatever primary holds it; lists across queues, newest first.
        for t in (*submitted, *delayed):
            got = (await http.get(f"/api/v1/tasks/{t['task_id']}")).json()
            assert got["queue"] == t["queue"]
        history = (await http.get(f"/api/v1/tasks/{dead['task_id']}/history")).json()
        assert history["history"][-1]["to"] == "dead_lettered"
        newest = (await http.get("/api/v1/tasks", params={"limit": 100})).json()["tasks"]
        assert [t["task_id"] for t in newest[:4]] == [
            t["task_id"] for t in reversed([*submitted, *delayed, dead][-4:])
        ]
        assert len(newest) == len(submitted) + len(delayed) + 1
        in_q2 = (await http.get("/api/v1/tasks", params={"queue": "q2"})).json()["tasks"]
        assert {t["queue"] for t in in_q2} == {"q2"} and len(in_q2) == 3
        dlq = (await http.get("/api/v1/dlq")).json()
        assert [d["task_id"] for d in dlq["dead_letters"]] == [dead["task_id"]]
        letter = (await http.get(f"/api/v1/dlq/{dead['task_id']}")).json()
        assert letter["task_id"] == dead["task_id"] and letter["queue"] == "q4"

        # Operator actions on queues of different primaries, then the audit across them.
        headers = {"X-API-Key": API_KEY}
        assert (await http.post("/api/v1/queue/q1/pause", headers=headers)).status_code == 200
        cancel = await http.post(f"/api/v1/tasks/{submitted[3]['task_id']}/cancel", headers=headers)
        assert cancel.status_code == 202
        requeue = await http.post(f"/api/v1/dlq/{dead['task_id']}/requeue", headers=headers)
        assert requeue.status_code == 200
        audit = (await http.get("/api/v1/audit")).json()["entries"]
        assert [(e["action"], e["queue"]) for e in audit][:3] == [
            ("dlq_requeue", "q4"),
            ("cancel", "q3"),
            ("queue_pause", "q1"),
        ]
        text = (await http.get("/metrics")).text
        assert gauge(text, "dtq_dlq_depth") == 0
        assert gauge(text, "dtq_queue_depth", "q4") == 1
        assert (await http.get("/api/v1/queues/q1")).json()["paused"] is True


async def test_the_hub_follows_a_failover_of_the_primary_it_listens_on(tmp_path: Path) -> None:
    """SIGKILL the primary that serves ``dtq:events``' slot and a queue's shard channel: once
    its replica took over, events of tasks submitted after that reach the hub again, with no
    restart (pub/sub keeps nothing: the events of the outage itself may be lost)."""
    with start_cluster(tmp_path / "cluster", node_timeout_ms=1000) as cluster:
        csettings = api_settings(Settings(redis_url=cluster.url, redis_cluster=True))
        q = await connect(settings=csettings)
        listener = await connect(settings=csettings)  # the hub's client sends nothing else
        hub = EventHub(listener.redis, refresh_s=0.2)
        try:
            rc = q.redis
            assert isinstance(rc, RedisCluster)
            victim = node_of(rc, keys.EVENTS)
            queue = next(f"q{i}" for i in range(100) if node_of(rc, keys.events(f"q{i}")) == victim)
            await q.submit("api_echo", {}, queue=queue)  # registers the queue
            await hub.start()
            sub = hub.add(EventFilter())
            if keys.sharded_events():
                channel = keys.events(queue)

                async def followed() -> bool:
                    return channel in shard_channels(rc)[victim]

                await wait_until(followed, 5, "the hub subscribed to the queue's channel")
            cluster.kill(int(victim.rsplit(":", 1)[1]))
            await asyncio.to_thread(cluster.wait_healthy, 20)
            after: set[str] = set()

            async def an_event_arrives() -> bool:
                with contextlib.suppress(RedisError, RedisUnavailableError):
                    after.add((await q.submit("api_echo", {}, queue=queue)).task_id)
                seen = {json.loads(raw)["task_id"] for raw, _ in sub.buffer}
                return bool(after & seen)

            await wait_until(an_event_arrives, 20, "an event after the failover")
            assert isinstance(listener.redis, RedisCluster)
            assert node_of(listener.redis, keys.EVENTS) != victim  # its replica serves it now
        finally:
            await hub.stop()
            await listener.close()
            await q.close()


async def test_a_server_that_refuses_info_gets_the_classic_channel(
    csettings: Settings, rc: RedisCluster
) -> None:
    """INFO denied (by an ACL here; renamed on some managed services): events stay on
    ``dtq:events``, which every cluster delivers, and still arrive."""
    nodes = rc.get_nodes()
    for node in nodes:
        with sync_redis.Redis(host=node.host, port=node.port) as one:
            one.execute_command(
                "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info"
            )
    try:
        url = csettings.redis_url.replace("redis://", "redis://noinfo:pw@")
        q = await connect(settings=csettings.model_copy(update={"redis_url": url}))
        try:
            assert not keys.sharded_events()
            async with Events(rc, queues=()) as classic:
                t = await q.submit("api_echo", {}, queue="q1")
                await classic.wait_for("TASK_QUEUED", t.task_id)
        finally:
            await q.close()
    finally:
        for node in nodes:
            with sync_redis.Redis(host=node.host, port=node.port) as one:
                one.execute_command("ACL", "DELUSER", "noinfo")
