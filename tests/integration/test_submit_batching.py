"""Concurrent ``submit`` calls share round trips (the hot path is batched:
docs/performance.md).

``Store.submit`` sends a lone call at once; calls made while another is in flight wait for the
next batch and share it (``submit.lua`` calls of up to ``SUBMIT_CHUNK`` tasks, one pipeline).
Each is still decided on its own: its own task, its own error, and a call cancelled before its
batch is sent is never sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.errors import IdempotencyInProgressError, RedisUnavailableError
from dtq.models import TaskStatus
from dtq.scripts import Call


async def _stream_len(r: Redis, queue: str = "default") -> int:
    return sum([await r.xlen(k) for k in keys.queue_streams(queue)])


def count_round_trips(queue: Queue, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tasks in each round trip of submit.lua calls the queue sends."""
    trips: list[int] = []
    scripts = queue.scripts
    call, call_many = scripts.call, scripts.call_many

    def tasks_in(args: Sequence[Any]) -> int:
        return (len(args) - 6) // 15  # submit.lua: 6 common ARGV, 15 per task

    async def one(redis: Redis, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if name == "submit":
            trips.append(tasks_in(args))
        return await call(redis, name, keys, args)

    async def many(redis: Redis, calls: Sequence[Call]) -> list[Any]:
        if calls and calls[0][0] == "submit":
            trips.append(sum(tasks_in(args) for _, _, args in calls))
        return await call_many(redis, calls)

    monkeypatch.setattr(scripts, "call", one)
    monkeypatch.setattr(scripts, "call_many", many)
    return trips


async def test_concurrent_submits_share_round_trips(
    queue: Queue, r: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    trips = count_round_trips(queue, monkeypatch)
    tasks = await asyncio.gather(*(queue.submit("echo_task", {"i": i}) for i in range(64)))

    assert len({t.task_id for t in tasks}) == 64
    assert [t.payload["i"] for t in tasks] == list(range(64))
    assert sum(trips) == 64
    assert len(trips) <= 3  # the first call alone, the 63 others together
    for t in tasks:
        assert await r.hget(keys.task(t.task_id), "status") == TaskStatus.QUEUED.value
    assert await _stream_len(r) == 64


async def test_a_lone_submit_is_sent_at_once(
    queue: Queue, r: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    trips = count_round_trips(queue, monkeypatch)
    for i in range(3):
        await queue.submit("echo_task", {"i": i})
    assert trips == [1, 1, 1]


async def test_errors_stay_with_their_call(queue: Queue, r: Redis) -> None:
    first = await queue.submit("echo_task", {}, idempotency_key="busy")
    results = await asyncio.gather(
        *(queue.submit("echo_task", {"i": i}) for i in range(5)),
        queue.submit("echo_task", {}, idempotency_key="busy"),
        *(queue.submit("echo_task", {"i": i}) for i in range(5, 10)),
        return_exceptions=True,
    )
    refused = results[5]
    assert isinstance(refused, IdempotencyInProgressError)
    assert refused.details["task_id"] == first.task_id
    accepted = results[:5] + results[6:]
    assert all(not isinstance(t, BaseException) for t in accepted)
    assert await _stream_len(r) == 11


async def test_a_call_cancelled_before_its_batch_is_sent_is_not_sent(
    queue: Queue, r: Redis
) -> None:
    in_flight = asyncio.create_task(queue.submit("echo_task", {"n": 1}))
    await asyncio.sleep(0)  # sent: it waits for Redis
    waiting = asyncio.create_task(queue.submit("echo_task", {"n": 2}))
    await asyncio.sleep(0)  # queued for the next pipeline, not sent yet
    waiting.cancel()
    sent = await in_flight
    with pytest.raises(asyncio.CancelledError):
        await waiting
    ids = await r.zrange(keys.RECENT, 0, -1)
    assert ids == [sent.task_id]
    assert await _stream_len(r) == 1


async def test_redis_down_reaches_every_waiting_call(settings: Settings) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    dead = Settings(**{**settings.model_dump(), "redis_url": url})
    q = Queue(Redis.from_url(url, decode_responses=True, socket_connect_timeout=1), dead)
    try:
        results = await asyncio.gather(
            *(q.submit("echo_task", {"i": i}) for i in range(8)), return_exceptions=True
        )
    finally:
        await q.close()
    assert all(isinstance(e, RedisUnavailableError) for e in results), results
