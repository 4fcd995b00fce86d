"""A worker rides out a Redis restart: its loops log and retry, scripts are loaded again
(NOSCRIPT), and the work submitted after the restart runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import connect
from dtq.config import Settings
from dtq.devserver import free_port, start_redis
from dtq_tasks import TaskContext
from support import running_worker
from support.worker import fast, handlers, wait_status

pytestmark = pytest.mark.slow


async def test_worker_survives_a_redis_restart(tmp_path: Path) -> None:
    port = free_port()
    server = start_redis(tmp_path / "redis", port=port, persistent=True)
    ran: list[str] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(payload["name"])

    settings = fast(Settings(redis_url=server.url))
    try:
        queue = await connect(settings=settings)
        r = Redis.from_url(server.url, decode_responses=True)
        try:
            async with running_worker(settings, handlers(wt_rec=record)):
                before = await queue.submit("wt_rec", {"name": "before"})
                await wait_status(r, before.task_id, "succeeded")
                server.stop()
                server = start_redis(tmp_path / "redis", port=port, persistent=True)
                await queue.close()  # the producer's pooled connections died with the server
                await r.aclose()
                queue = await connect(settings=settings)
                r = Redis.from_url(server.url, decode_responses=True)
                after = await queue.submit("wt_rec", {"name": "after"})
                await wait_status(r, after.task_id, "succeeded", timeout_s=15)
        finally:
            await r.aclose()
            await queue.close()
    finally:
        server.stop()
    assert ran == ["before", "after"]
