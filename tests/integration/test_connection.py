"""The SDK's and the worker's clients pack commands with hiredis, on the same wire format."""

from __future__ import annotations

from redis.asyncio import Redis

from dtq import Queue, connect
from dtq.config import Settings
from dtq.connection import HIREDIS_AVAILABLE
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
