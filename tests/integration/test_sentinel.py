"""A Sentinel-managed primary (docs/operations.md, "Sentinel"): the SDK, a worker process, the
API and the CLI configured with the sentinel settings only (their DTQ_REDIS_URL names no
server) find the primary through the sentinels, and follow a failover without a restart.

The topology is dtq.devsentinel's (a primary, a replica, three sentinels) from
DTQ_REDIS_SERVER's binary; ``make test`` runs this file on redis-server 6.2 and valkey-server
8.1. The failover test kills the primary of a group of its own with SIGKILL under a steady
submit, reports the outage (first failed to first successful submit after it) and the tasks
that asynchronous replication lost, and checks that every other accepted task ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as sync_redis
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.sentinel import SentinelManagedConnection as SyncSentinelManagedConnection

from dtq import Queue, connect, keys
from dtq.api.errors import status_for
from dtq.config import Settings
from dtq.connection import sync_client
from dtq.devsentinel import DevSentinel, start_sentinel_group
from dtq.devserver import free_port
from dtq.errors import DtqError, RedisUnavailableError, TaskNotFoundError
from dtq.models import TERMINAL, TaskStatus
from support.api import running_api
from support.cli import Cli
from support.waiting import wait_until
from support.worker import FAST, WorkerProcess, wait_worker_ready

TASKS = '''
"""Task types of the Sentinel tests' worker processes (no Redis of their own)."""
from dtq_tasks import task


@task("sn_echo")
async def sn_echo(payload, ctx):
    return payload
'''


def write_tasks(folder: Path) -> None:
    (folder / "sn_tasks.py").write_text(TASKS)


def managed_settings(group: DevSentinel, **overrides: Any) -> Settings:
    """Settings naming the group's sentinels only; the API accepts any task type."""
    return Settings(**{**group.settings_fields(), **FAST, "task_modules": "", **overrides})


@pytest.fixture
def sentinel_settings(sentinel_group: DevSentinel) -> Settings:
    """The session's group, its primary's data flushed."""
    client = sync_redis.Redis.from_url(sentinel_group.primary_url())
    try:
        client.flushall()
    finally:
        client.close()
    return managed_settings(sentinel_group)


@pytest.fixture
async def managed(sentinel_settings: Settings) -> AsyncIterator[Queue]:
    q = await connect(settings=sentinel_settings)
    yield q
    await q.close()


@contextlib.contextmanager
def worker_process(group: DevSentinel, folder: Path, worker_id: str) -> Iterator[WorkerProcess]:
    write_tasks(folder)
    env = {**group.environ(), "DTQ_TASK_MODULES": "sn_tasks"}
    proc = WorkerProcess(
        "redis://127.0.0.1:1/0", folder, worker_id=worker_id, env=env, tasks="sn_tasks"
    )
    try:
        yield proc
    finally:
        proc.stop()


async def ended(q: Queue, task_id: str) -> bool:
    return (await q.get(task_id)).status in TERMINAL


# -- each surface with the sentinel settings only ------------------------------------------------


async def test_sdk_finds_the_primary_through_the_sentinels(
    sentinel_group: DevSentinel, managed: Queue
) -> None:
    pool = managed.redis.connection_pool
    assert issubclass(pool.connection_class, SentinelManagedConnection)
    assert pool.connection_class.pack_command.__qualname__ == "_HiredisPacking.pack_command"
    task = await managed.submit("sn_echo", {"n": 1})
    assert (await managed.get(task.task_id)).status == TaskStatus.QUEUED
    direct = sync_redis.Redis.from_url(sentinel_group.primary_url(), decode_responses=True)
    try:  # written on the primary the sentinels name, not on the URL's (unused) address
        assert direct.exists(keys.task(task.task_id)) == 1
    finally:
        direct.close()


def test_heartbeat_client_finds_the_primary(sentinel_settings: Settings) -> None:
    client = sync_client(sentinel_settings, socket_timeout=2)
    try:
        assert issubclass(client.connection_pool.connection_class, SyncSentinelManagedConnection)
        assert client.info("replication")["role"] == "master"
    finally:
        client.close()


async def test_worker_process_runs_tasks_through_the_sentinels(
    sentinel_group: DevSentinel, managed: Queue, tmp_path: Path
) -> None:
    with worker_process(sentinel_group, tmp_path, "sn-worker") as proc:
        await wait_worker_ready(managed.redis, "sn-worker")
        task = await managed.submit("sn_echo", {"n": 2})
        await wait_until(lambda: ended(managed, task.task_id), 15, "task done")
        done = await managed.get(task.task_id)
        assert done.status == TaskStatus.SUCCEEDED, proc.output()


async def test_api_serves_through_the_sentinels(sentinel_settings: Settings) -> None:
    async with running_api(sentinel_settings) as api:
        assert (await api.client.get("/ready")).status_code == 200
        created = await api.submit(task_type="sn_echo", payload={"n": 3})
        resp = await api.client.get(f"/api/v1/tasks/{created['task_id']}")
        assert resp.status_code == 200 and resp.json()["status"] == "queued"


def test_cli_through_the_sentinels(
    sentinel_group: DevSentinel, sentinel_settings: Settings
) -> None:
    cli = Cli("redis://127.0.0.1:1/0", **sentinel_group.environ(), DTQ_TASK_MODULES="")
    task_id = cli.ok("submit", "--type", "sn_echo", "--payload", '{"n": 4}', "-q").out.strip()
    assert cli.ok("get", task_id, "--json").json()["status"] == "queued"


def test_cli_names_the_sentinels_when_none_answers(tmp_path: Path) -> None:
    where = f"127.0.0.1:{free_port()}"
    cli = Cli(
        "redis://:pw-in-url@127.0.0.1:1/0",
        DTQ_REDIS_SENTINELS=where,
        DTQ_REDIS_SENTINEL_MASTER="nobody",
        DTQ_REDIS_SENTINEL_PASSWORD="sentinel-secret",
    )
    run = cli.fails(1, "list")
    assert f"primary 'nobody' via sentinels {where}" in run.err
    assert "sentinel-secret" not in run.err and "pw-in-url" not in run.err


async def test_passwords_of_the_primary_and_of_the_sentinels(tmp_path: Path) -> None:
    """The primary's password comes from DTQ_REDIS_URL, the sentinels' from
    DTQ_REDIS_SENTINEL_PASSWORD; without the latter no primary is found, in one short line."""
    group = await asyncio.to_thread(
        start_sentinel_group, tmp_path, password="primary-pw", sentinel_password="sentinel-pw"
    )
    try:
        settings = managed_settings(group)
        assert settings.redis_url.startswith("redis://:primary-pw@")
        q = await connect(settings=settings)
        try:
            task = await q.submit("sn_echo", {})
            assert (await q.get(task.task_id)).status == TaskStatus.QUEUED
        finally:
            await q.close()
        client = sync_client(settings, socket_timeout=2)
        try:
            assert client.ping()
        finally:
            client.close()
        with pytest.raises(RedisUnavailableError) as exc:
            await connect(settings=managed_settings(group, redis_sentinel_password=""))
        message = str(exc.value)
        assert (
            "no sentinel names a primary 'dtq-primary'" in message and "Authentication" in message
        )
        assert len(message) < 400 and "\n" not in message
    finally:
        await asyncio.to_thread(group.stop)


# -- a primary that was demoted to a replica ----------------------------------------------------


@pytest.fixture
def demoted(sentinel_group: DevSentinel, sentinel_settings: Settings) -> Iterator[Settings]:
    """Settings whose primary is the group's replica, as a sentinel that has not yet seen a
    failover names the demoted old primary: the sentinels also monitor the replica under a
    name of its own (for the test's length: it never looks down to them)."""
    replica = next(s for s in sentinel_group.servers if s.port != sentinel_group.primary.port)
    for sentinel in sentinel_group.sentinels:
        with sync_redis.Redis(port=sentinel.port) as client:
            client.sentinel_monitor("demoted", "127.0.0.1", replica.port, 2)
            client.sentinel_set("demoted", "down-after-milliseconds", 600_000)
    try:
        yield managed_settings(sentinel_group, redis_sentinel_master="demoted")
    finally:
        for sentinel in sentinel_group.sentinels:
            with sync_redis.Redis(port=sentinel.port) as client:
                client.sentinel_remove("demoted")


async def test_a_write_refused_by_a_replica_drops_the_connection(demoted: Settings) -> None:
    """Every kind of script call (one submit, a batch, a script that does not catch errors)
    fails as Redis unavailable on a replica, and leaves no connection to it in the pool: the
    next connection asks the sentinels again (redis-py reconnects only on a connection error)."""
    q = await connect(settings=demoted)
    try:
        pool = q.redis.connection_pool
        for write in (
            lambda: q.submit("sn_echo", {}),
            lambda: q.submit_many([{"task_type": "sn_echo", "payload": {}}] * 2),
            lambda: q.pause_queue("default"),
        ):
            with pytest.raises(RedisUnavailableError):
                await write()
            assert not [c for c in pool._available_connections if c.is_connected]
    finally:
        await q.close()
    client = sync_client(demoted, socket_timeout=2)  # the heartbeat thread's, its touch script
    try:
        with pytest.raises(sync_redis.ConnectionError):
            client.eval("return redis.call('SET', KEYS[1], '1')", 1, "dtq-test:demoted")
        assert not [c for c in client.connection_pool._available_connections if c._sock]
    finally:
        client.close()


# -- a failover under steady submits -------------------------------------------------------------


@dataclass
class Producer:
    """Submits at a steady pace through the API and the SDK; records what each answer was."""

    accepted: list[str] = field(default_factory=list)
    failures: int = 0
    first_failed: float | None = None
    recovered: float | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def ok(self, task_id: str) -> None:
        self.accepted.append(task_id)
        if self.first_failed is not None and self.recovered is None:
            self.recovered = time.monotonic()

    def failed(self) -> None:
        self.failures += 1
        if self.first_failed is None:
            self.first_failed = time.monotonic()

    async def through_api(self, client: httpx.AsyncClient, every_s: float) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            resp = await client.post(
                "/api/v1/tasks", json={"task_type": "sn_echo", "payload": {"api": n}}
            )
            if resp.status_code == 202:
                self.ok(resp.json()["task_id"])
            else:
                # Redis unavailable (or, with replicated submits, not confirmed in time)
                assert resp.status_code == 503, resp.text
                self.failed()
            await asyncio.sleep(every_s)

    async def through_sdk(self, q: Queue, every_s: float) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                task = await q.submit("sn_echo", {"sdk": n})
            except DtqError as exc:  # what the API answers 503 for, as through_api accepts
                assert status_for(exc) == 503, exc
                self.failed()
            else:
                self.ok(task.task_id)
            await asyncio.sleep(every_s)


@pytest.mark.slow
@pytest.mark.parametrize("min_replicas", [0, 1])
async def test_failover_under_steady_submit(
    tmp_path: Path, min_replicas: int, report_figure: Callable[[str], None]
) -> None:
    """SIGKILL the primary while the API and the SDK submit: submits fail for the outage and
    then succeed again on the promoted replica, without restarting the worker, the API or the
    SDK's client; every accepted task reaches a terminal state, except those asynchronous
    replication lost (counted; with ``min_replicas`` > 0, replicated submits, none may be)."""
    group = await asyncio.to_thread(start_sentinel_group, tmp_path / "group")
    try:
        overrides = {"submit_min_replicas": min_replicas} if min_replicas else {}
        settings = managed_settings(group, **overrides)
        with worker_process(group, tmp_path, "sn-failover") as worker:
            q = await connect(settings=settings)
            try:
                await wait_worker_ready(q.redis, "sn-failover")
                async with running_api(settings) as api:
                    outage = await _kill_under_load(group, q, api.client, min_replicas)
                lost = await _drain(q, outage.accepted)
                # The heartbeat thread's own client followed too: its beat is written again.
                await q.redis.delete(keys.worker("sn-failover"))
                await wait_worker_ready(q.redis, "sn-failover", timeout_s=10)
                assert worker.process.poll() is None, "the worker must not have restarted"
                cli = Cli("redis://127.0.0.1:1/0", **group.environ())  # asks the sentinels anew
                last = await asyncio.to_thread(cli.ok, "get", outage.accepted[-1], "--json")
                assert last.json()["status"] == "succeeded"
            finally:
                await q.close()
        assert outage.first_failed is not None, "no submit failed: the primary was not killed?"
        assert outage.recovered is not None, "no submit succeeded after the failover"
        outage_s = outage.recovered - outage.first_failed
        report_figure(
            f"sentinel failover ({Path(group.binary).name}, min_replicas={min_replicas}): "
            f"outage {outage_s:.2f} s (first failed to first successful submit), "
            f"{outage.failures} failed submits, {len(outage.accepted)} accepted, "
            f"{len(lost)} lost by asynchronous replication"
        )
        assert outage_s < 20
        if min_replicas:
            assert lost == [], f"{len(lost)} accepted tasks lost despite replicated submits"
        assert len(lost) < len(outage.accepted) / 2, "more lost than a replication lag explains"
    finally:
        await asyncio.to_thread(group.stop)


async def _kill_under_load(
    group: DevSentinel, q: Queue, client: httpx.AsyncClient, min_replicas: int
) -> Producer:
    """Submit steadily, SIGKILL the primary once some tasks are in, and go on until submits
    have succeeded again for a while after the failover. With replicated submits the promoted
    replica has no replica of its own (the group had one): submits are refused (503, never a
    202 it cannot keep) until a new replica joins, as an operator would add one."""
    producer = Producer()
    runs = [
        asyncio.create_task(producer.through_api(client, 0.01)),
        asyncio.create_task(producer.through_sdk(q, 0.01)),
    ]
    try:
        await wait_until(lambda: _at_least(producer, 50), 15, "submits before the kill")
        await asyncio.to_thread(group.kill_primary)
        await asyncio.to_thread(group.wait_failover, 30)
        if min_replicas:
            await asyncio.to_thread(group.add_replica)
        await wait_until(lambda: _recovered_for(producer, 0.5), 30, "submits after the failover")
    finally:
        producer.stop.set()
        await asyncio.gather(*runs)
    return producer


async def _at_least(producer: Producer, n: int) -> bool:
    return len(producer.accepted) >= n


async def _recovered_for(producer: Producer, seconds: float) -> bool:
    return producer.recovered is not None and time.monotonic() - producer.recovered > seconds


async def _drain(q: Queue, accepted: list[str]) -> list[str]:
    """Wait until every accepted task is terminal or known lost (no hash on the new primary);
    returns the lost ones."""
    lost: set[str] = set()
    waiting = set(accepted)

    async def drained() -> bool:
        for task_id in list(waiting):
            try:
                task = await q.get(task_id)
            except TaskNotFoundError:
                lost.add(task_id)
                waiting.discard(task_id)
                continue
            if task.status in TERMINAL:
                assert task.status == TaskStatus.SUCCEEDED, task
                waiting.discard(task_id)
        return not waiting

    await wait_until(drained, 45, f"{len(accepted)} accepted tasks terminal", every_s=0.2)
    return sorted(lost)
