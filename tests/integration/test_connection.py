"""The SDK's and the worker's clients pack commands with hiredis, on the same wire format; the
start-up durability check they share."""

from __future__ import annotations

import logging

import pytest
from redis.asyncio import Redis

from dtq import Queue, connect
from dtq.config import Settings
from dtq.connection import HIREDIS_AVAILABLE, warn_durability
from dtq.worker.connection import worker_redis


async def test_sdk_and_worker_clients_pack_with_hiredis(settings: Settings, r: Redis) -> None:
    assert HIREDIS_AVAILABLE  # dtq depends on redis[hiredis]
    queue: Queue = await connect(settings=settings)
    worker = worker_redis(settings)
    try:
        for client in (queue.redis, worker):
            packer = client.connection_pool.connection_class.pack_command
            assert packer.__qualname__ == "_HiredisPacking.pack_command"
        payload = {"text": "héllo \r\n$*", "n": [1, 2.5, None]}
        task = await queue.submit("echo_task", payload)
        assert (await queue.get(task.task_id)).payload == payload
        await worker.set("dtq-test:packed", "a\r\nb é")
        assert await r.get("dtq-test:packed") == "a\r\nb é"
    finally:
        await worker.aclose()
        await queue.close()


async def test_durability_warnings_name_what_redis_may_lose(
    r: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The one check the API and the worker run at start: an evicting policy and AOF off are
    each one warning; noeviction with AOF on is silent."""
    log = logging.getLogger("dtq.test.durability")
    before = await r.config_get("maxmemory-policy")
    before_aof = await r.config_get("appendonly")
    try:
        await r.config_set("maxmemory-policy", "allkeys-lru")
        await r.config_set("appendonly", "no")
        with caplog.at_level(logging.WARNING, logger=log.name):
            await warn_durability(r, log)
        lines = [rec.getMessage() for rec in caplog.records if rec.name == log.name]
        assert lines == [
            "Redis maxmemory-policy is 'allkeys-lru', not 'noeviction': Redis may evict task data",
            "Redis AOF is off: a Redis crash loses the tasks written since the last save",
        ]
        caplog.clear()
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("appendonly", "yes")
        with caplog.at_level(logging.WARNING, logger=log.name):
            await warn_durability(r, log)
        assert [rec for rec in caplog.records if rec.name == log.name] == []
    finally:
        await r.config_set("maxmemory-policy", before["maxmemory-policy"])
        await r.config_set("appendonly", before_aof["appendonly"])
