"""A script call is sent at most once, whatever retry policy the client was built with: a reply
lost after the script ran is an error for the caller, never a second run. And one item that
fails in a batch of coalesced submits fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from dtq import Queue, connect
from dtq import keys as dtq_keys
from dtq.config import Settings
from dtq.errors import RedisUnavailableError
from dtq.models import Task
from dtq.store import SUBMIT_CHUNK
from dtq.worker.connection import worker_redis
from support.wire import LosingConnection, losing_client, reset


@pytest.fixture
async def retrying_queue(settings: Settings, r: Redis) -> AsyncIterator[Queue]:
    """A Queue on a client built by hand, with redis-py retrying every failed command 3 times."""
    client = losing_client(settings.redis_url, Retry(NoBackoff(), 3))
    reset(killer=r)
    q = Queue(client, settings)
    await q.scripts.load(client)
    yield q
    reset()
    await q.close()


async def _entries(r: Redis) -> int:
    """Stream entries of queue default: one per submit that ran (a submit run again with the
    same task id adds a second entry for it)."""
    return sum([await r.xlen(k) for k in dtq_keys.queue_streams("default")])


async def test_a_lost_reply_of_one_script_call_is_not_retried(
    retrying_queue: Queue, r: Redis
) -> None:
    LosingConnection.lose_next_script_reply = True
    with pytest.raises(RedisUnavailableError, match="connection lost"):
        await retrying_queue.submit("echo_task", {"n": 1})
    assert not LosingConnection.lose_next_script_reply  # the reply was lost, as arranged
    assert await _entries(r) == 1  # the script ran, and ran once
    # The client is usable again, on a new connection.
    task = await retrying_queue.submit("echo_task", {"n": 2})
    assert task.payload == {"n": 2}
    assert await _entries(r) == 2


async def test_a_lost_reply_of_a_batch_is_not_retried(retrying_queue: Queue, r: Redis) -> None:
    n = SUBMIT_CHUNK + 8  # two script calls, one write: the batch path
    LosingConnection.lose_next_script_reply = True
    with pytest.raises(RedisUnavailableError, match="connection lost"):
        await retrying_queue.submit_many([{"task_type": "echo_task"}] * n)
    assert not LosingConnection.lose_next_script_reply
    assert await _entries(r) == n  # each script ran once
    results = await retrying_queue.submit_many([{"task_type": "echo_task"}] * n)
    assert all(isinstance(t, Task) for t in results)
    assert await _entries(r) == 2 * n


async def test_dtq_clients_never_retry(settings: Settings) -> None:
    """The SDK's and the worker's clients pin retries off, whatever redis-py's default is."""
    q = await connect(settings=settings)
    w = worker_redis(settings)
    try:
        for client in (q.redis, w):
            retry = client.connection_pool.connection_kwargs.get("retry")
            assert isinstance(retry, Retry) and retry.get_retries() == 0
            conn = client.connection_pool.make_connection()
            assert conn.retry.get_retries() == 0
    finally:
        await q.close()
        await w.aclose()


async def test_one_failed_submit_of_a_coalesced_batch_fails_alone(queue: Queue, r: Redis) -> None:
    """Submits made while one is in flight share the next batch (one script call). A Redis
    error in one of them (a key of the wrong type) is that submit's error; the others of the
    batch were committed and get their tasks."""
    await r.rpush(dtq_keys.idempotency("default", "poison"), "not a record")
    first, poisoned, *others = await asyncio.gather(
        queue.submit("echo_task", {"i": 0}),  # alone: the others wait for the next batch
        queue.submit("echo_task", {"i": 1}, idempotency_key="poison"),
        queue.submit("echo_task", {"i": 2}),
        queue.submit("echo_task", {"i": 3}),
        return_exceptions=True,
    )
    assert isinstance(first, Task)
    assert isinstance(poisoned, ResponseError) and "WRONGTYPE" in str(poisoned)
    assert all(isinstance(t, Task) for t in others), others
    stored = await queue.store.get_many([t.task_id for t in others if isinstance(t, Task)])
    assert [t.payload for t in stored] == [{"i": 2}, {"i": 3}]
    assert await _entries(r) == 3
