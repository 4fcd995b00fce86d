"""Replicated submits (DTQ_SUBMIT_MIN_REPLICAS, docs/delivery-guarantees.md): against a real
primary and a real replica of it, both started by this module from the test suite's server
binary (DTQ_REDIS_SERVER: redis or valkey). The replica is made unable to confirm by SIGSTOP:
it keeps its link to the primary, so WAIT waits for an acknowledgement that does not come.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from dtq import Queue, Task, connect, keys
from dtq.config import Settings, load_settings
from dtq.devserver import RedisServer, start_redis
from dtq.errors import ConfigError, IdempotencyInProgressError, ReplicationTimeoutError
from support.api import api_settings, error_of, running_api
from support.cli import Cli
from support.waiting import wait_until, wait_until_sync
from support.worker import fast, handlers, running_worker, wait_status

# WAIT's timeout: of the submits made while the replica is stopped (each takes all of it), of
# those made while it runs (never reached: a margin for a loaded machine), and of the API and
# the CLI, which make both kinds with one setting.
STOPPED_MS = 300
LIVE_MS = 10_000
SURFACE_MS = 1_000


@dataclass
class Pair:
    primary: RedisServer
    replica: RedisServer

    @property
    def url(self) -> str:
        return self.primary.url

    def in_sync(self) -> bool:
        """The replica has every write the primary made so far (a write, then WAIT on it)."""
        client = sync_redis.Redis.from_url(self.primary.url)
        try:
            client.set("replication-check", "1")  # outside dtq's key space, flushed per test
            return int(client.execute_command("WAIT", 1, 2000)) >= 1
        finally:
            client.close()

    @contextlib.contextmanager
    def replica_stopped(self) -> Iterator[None]:
        """The replica frozen (SIGSTOP) for the block: linked, but acknowledging nothing."""
        os.kill(self.replica.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.replica.pid, signal.SIGCONT)
        wait_until_sync(self.in_sync, what="the replica caught up after SIGCONT")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    primary = start_redis(Path(tmp_path_factory.mktemp("primary")))
    replica = start_redis(Path(tmp_path_factory.mktemp("replica")))
    pair = Pair(primary, replica)
    try:
        client = sync_redis.Redis.from_url(replica.url)
        client.replicaof("127.0.0.1", primary.port)
        client.close()
        wait_until_sync(pair.in_sync, timeout_s=20, what="the replica in sync with its primary")
        yield pair
    finally:
        os.kill(replica.pid, signal.SIGCONT)  # a test that failed while it was stopped
        replica.stop()
        primary.stop()


@pytest.fixture
def pair(servers: Pair) -> Pair:
    client = sync_redis.Redis.from_url(servers.url)
    client.flushall()
    wait_until_sync(servers.in_sync, what="the flush replicated")
    client.config_resetstat()
    client.close()
    return servers


def replicated(pair: Pair, replicas: int = 1, timeout_ms: int = LIVE_MS) -> Settings:
    return Settings(
        redis_url=pair.url, submit_min_replicas=replicas, submit_replica_timeout_ms=timeout_ms
    )


@pytest.fixture
async def q(pair: Pair) -> AsyncIterator[Queue]:
    """The SDK for submits made while the replica runs."""
    queue = await connect(settings=replicated(pair))
    yield queue
    await queue.close()


@pytest.fixture
async def impatient(pair: Pair) -> AsyncIterator[Queue]:
    """The SDK for submits made while the replica is stopped."""
    queue = await connect(settings=replicated(pair, timeout_ms=STOPPED_MS))
    yield queue
    await queue.close()


@pytest.fixture
async def primary(pair: Pair) -> AsyncIterator[Redis]:
    client = Redis.from_url(pair.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def replica(pair: Pair) -> AsyncIterator[Redis]:
    client = Redis.from_url(pair.replica.url, decode_responses=True)
    yield client
    await client.aclose()


async def wait_calls(r: Redis) -> int:
    """How many WAIT commands the server ran since the test began (CONFIG RESETSTAT)."""
    stats: dict[str, Any] = await r.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


# -- confirmed ----------------------------------------------------------------------------------


async def test_with_a_live_replica_a_submit_answers_as_today_and_the_replica_has_it(
    q: Queue, primary: Redis, replica: Redis
) -> None:
    task = await q.submit("rp_echo", {"n": 1}, idempotency_key="live-1")
    assert (task.status, task.duplicate) == ("queued", False)
    # Answered only once the replica had it: no waiting for replication here.
    assert await replica.hget(keys.task(task.task_id), "status") == "queued"
    assert await replica.get(keys.idempotency("default", "live-1"))

    before = await wait_calls(primary)
    await q.submit("rp_echo", {"n": 2})
    many = await q.submit_many([{"task_type": "rp_echo", "payload": {"i": i}} for i in range(40)])
    assert all(isinstance(t, Task) and t.status == "queued" for t in many), many
    for t in many:
        assert isinstance(t, Task)
        assert await replica.exists(keys.task(t.task_id)) == 1
    # One WAIT per batch (the 40 tasks are two script calls, one round trip), none per task.
    assert await wait_calls(primary) - before == 2


async def test_min_replicas_0_sends_no_wait(pair: Pair, primary: Redis) -> None:
    async with await connect(settings=replicated(pair, replicas=0)) as q:
        await q.submit("rp_echo", {}, idempotency_key="zero")
        with pytest.raises(IdempotencyInProgressError):
            await q.submit("rp_echo", {}, idempotency_key="zero")
        await q.submit_many([{"task_type": "rp_echo"}] * 40)
    assert await wait_calls(primary) == 0


# -- not confirmed ------------------------------------------------------------------------------


async def test_unconfirmed_submit_raises_with_the_task_id_and_the_task_stays(
    pair: Pair, q: Queue, impatient: Queue, primary: Redis
) -> None:
    with pair.replica_stopped():
        with pytest.raises(ReplicationTimeoutError) as exc:
            await impatient.submit("rp_echo", {"n": 1}, idempotency_key="order-7")
        many = await impatient.submit_many(
            [{"task_type": "rp_echo", "idempotency_key": "order-8"}, {"task_type": "rp_echo"}]
        )
    err = exc.value
    assert err.code == "REPLICATION_TIMEOUT"
    assert err.duplicate is False and isinstance(err.task, Task)
    assert err.task.task_id == err.task_id
    assert err.details == {
        "task_id": err.task_id,
        "duplicate": False,
        "replicas": 0,
        "min_replicas": 1,
    }
    assert err.task_id in err.message and "not rolled back" in err.message
    assert "same idempotency key is safe" in err.message
    # Accepted by the primary all the same: not rolled back, it waits for a worker.
    assert await primary.hget(keys.task(err.task_id), "status") == "queued"
    assert all(isinstance(m, ReplicationTimeoutError) for m in many), many
    keyed, unkeyed = many
    assert isinstance(keyed, ReplicationTimeoutError) and isinstance(
        unkeyed, ReplicationTimeoutError
    )
    assert "a retry submits a second task" in unkeyed.message
    for m in (keyed, unkeyed):
        assert await primary.hget(keys.task(m.task_id), "status") == "queued"

    # The replica is back: a retry with the same key names the same task, confirmed (in
    # progress while it waits, the stored task once it ran); no second task.
    with pytest.raises(IdempotencyInProgressError) as busy:
        await q.submit("rp_echo", {"n": 1}, idempotency_key="order-7")
    assert busy.value.details["task_id"] == err.task_id

    async def echo(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
        return payload

    async with running_worker(fast(replicated(pair)), handlers(rp_echo=echo)):
        for m in (err, keyed, unkeyed):
            await wait_status(primary, m.task_id, "succeeded")
    again = await q.submit("rp_echo", {"n": 1}, idempotency_key="order-7")
    assert (again.task_id, again.duplicate, again.status) == (err.task_id, True, "succeeded")
    assert await primary.zcard(keys.RECENT) == 3


async def test_a_replay_is_answered_only_once_the_replicas_have_the_task(
    pair: Pair, impatient: Queue
) -> None:
    """The replay's own connection may have nothing of the task to wait for: here its last
    write (an earlier submit) was confirmed before the task was written, by another client,
    while the replica was stopped. The replay must not be answered as confirmed."""
    async with await connect(settings=replicated(pair, timeout_ms=STOPPED_MS)) as other:

        async def confirmed() -> bool:
            try:
                await other.submit("rp_echo", {})
            except ReplicationTimeoutError:  # the replica was slow to answer: write again
                return False
            return True

        await wait_until(confirmed, what="a submit of the replaying client confirmed")
        with pair.replica_stopped():
            with pytest.raises(ReplicationTimeoutError) as first:
                await impatient.submit("rp_echo", {}, idempotency_key="replayed")
            with pytest.raises(ReplicationTimeoutError) as replay:
                await other.submit("rp_echo", {}, idempotency_key="replayed")
            await impatient.cancel(first.value.task_id)  # finished: a replay is now a "dup"
            with pytest.raises(ReplicationTimeoutError) as dup:
                await other.submit("rp_echo", {}, idempotency_key="replayed")
    assert replay.value.task_id == first.value.task_id
    assert replay.value.duplicate is True and replay.value.task is None
    assert "replay of an existing task" in replay.value.message
    assert dup.value.task_id == first.value.task_id and dup.value.duplicate is True
    assert isinstance(dup.value.task, Task) and dup.value.task.status == "cancelled"
    # The replica back, the same replay is answered: the stored task, confirmed.
    async with await connect(settings=replicated(pair)) as third:
        task = await third.submit("rp_echo", {}, idempotency_key="replayed")
    assert (task.task_id, task.duplicate) == (first.value.task_id, True)


async def test_api_answers_503_replication_timeout_with_the_task_id(
    pair: Pair, primary: Redis
) -> None:
    settings = api_settings(replicated(pair, timeout_ms=SURFACE_MS))
    async with running_api(settings) as api:
        with pair.replica_stopped():
            resp = await api.client.post(
                "/api/v1/tasks",
                json={"task_type": "api_echo", "payload": {}},
                headers={"Idempotency-Key": "http-1"},
            )
        assert resp.status_code == 503, resp.text
        err = error_of(resp)
        assert err["code"] == "REPLICATION_TIMEOUT"
        task_id = err["details"]["task_id"]
        assert err["details"]["duplicate"] is False and task_id in err["message"]
        assert resp.headers["retry-after"] == "1"
        got = await api.client.get(f"/api/v1/tasks/{task_id}")
        assert got.status_code == 200 and got.json()["status"] == "queued"
        # Counted as submitted (it was accepted), not as a rejected submission.
        metrics = (await api.client.get("/metrics")).text
        assert 'dtq_tasks_submitted_total{queue="default",task_type="api_echo"} 1.0' in metrics
        assert "dtq_ingest_rejected_total{" not in metrics
        # The retry with the same key, now confirmed: the key's task, in progress.
        retry = await api.client.post(
            "/api/v1/tasks",
            json={"task_type": "api_echo", "payload": {}},
            headers={"Idempotency-Key": "http-1"},
        )
        assert retry.status_code == 409, retry.text
        assert error_of(retry)["details"]["task_id"] == task_id
    assert await primary.hget(keys.task(task_id), "status") == "queued"


async def test_cli_submit_exits_1_naming_the_task(pair: Pair, primary: Redis) -> None:
    cli = Cli(
        pair.url,
        DTQ_TASK_MODULES="",
        DTQ_SUBMIT_MIN_REPLICAS="1",
        DTQ_SUBMIT_REPLICA_TIMEOUT_MS=str(SURFACE_MS),
    )
    with pair.replica_stopped():
        run = cli.fails(1, "submit", "--type", "echo_task", "--idempotency-key", "cli-1")
    assert "not confirmed by its replicas" in run.err, run.err
    found = re.search(r"task ([0-9a-f]{32})", run.err)
    assert found, run.err
    task_id = found.group(1)
    assert await primary.hget(keys.task(task_id), "status") == "queued"
    # Confirmed now: the same key names the same task (in progress: exit 1, its id given).
    again = cli.fails(1, "submit", "--type", "echo_task", "--idempotency-key", "cli-1")
    assert task_id in again.err and "in progress" in again.err
    assert await primary.zcard(keys.RECENT) == 1


# -- edges of the exchange ----------------------------------------------------------------------


async def test_scripts_loaded_again_are_confirmed_by_a_wait_of_their_own(
    pair: Pair, q: Queue, impatient: Queue, primary: Redis
) -> None:
    """After NOSCRIPT the calls are sent again, with their own WAIT (the first one covered
    nothing of theirs): two WAITs, the smaller count decides."""
    await primary.script_flush()
    before = await wait_calls(primary)
    task = await q.submit("rp_echo", {})
    assert task.status == "queued"
    assert await wait_calls(primary) - before == 2
    await primary.script_flush()
    with pair.replica_stopped(), pytest.raises(ReplicationTimeoutError) as exc:
        await impatient.submit("rp_echo", {})
    assert await primary.hget(keys.task(exc.value.task_id), "status") == "queued"


async def test_a_refused_wait_reports_the_tasks_unconfirmed(pair: Pair, primary: Redis) -> None:
    """A server that refuses WAIT (here an ACL without it; renamed or disabled elsewhere):
    the scripts ran, so their tasks are named, unconfirmed, with Redis's reason."""
    await primary.acl_setuser(
        "nowait", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-wait"],
    )  # fmt: skip
    url = pair.url.replace("redis://", "redis://nowait:pw@")
    settings = Settings(redis_url=url, submit_min_replicas=1)
    try:
        async with await connect(settings=settings) as q:
            with pytest.raises(ReplicationTimeoutError) as exc:
                await q.submit("rp_echo", {}, idempotency_key="acl-1")
    finally:
        await primary.acl_deluser("nowait")
    assert "WAIT" in exc.value.message and exc.value.details["replicas"] == 0
    assert await primary.hget(keys.task(exc.value.task_id), "status") == "queued"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DTQ_SUBMIT_MIN_REPLICAS", "-1"),
        ("DTQ_SUBMIT_MIN_REPLICAS", "17"),
        ("DTQ_SUBMIT_REPLICA_TIMEOUT_MS", "0"),  # WAIT 0 would block forever
        ("DTQ_SUBMIT_REPLICA_TIMEOUT_MS", "60001"),
    ],
)
def test_settings_out_of_range_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}="):
        load_settings()
