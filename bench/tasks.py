"""The handlers the benchmark's workers run (``--tasks bench.tasks``).

``bench.noop`` does nothing; ``bench.rpush`` does one Redis RPUSH, like comparison harnesses;
``bench.sleep`` sleeps SLEEP_MS (the limits scenario's concurrency-bound work).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from redis.asyncio import Redis

from bench.harness import NOOP_TASK, RPUSH_KEY, RPUSH_TASK, SLEEP_MS, SLEEP_TASK
from dtq_tasks import task

_redis: Redis | None = None


def _client() -> Redis:
    global _redis
    if _redis is None:
        _redis = Redis.from_url(os.environ["DTQ_REDIS_URL"])
    return _redis


@task(NOOP_TASK)
async def noop(payload: dict[str, Any], ctx: Any) -> None:
    return None


@task(RPUSH_TASK)
async def rpush(payload: dict[str, Any], ctx: Any) -> None:
    await _client().rpush(RPUSH_KEY, ctx.task_id)


@task(SLEEP_TASK)
async def sleep(payload: dict[str, Any], ctx: Any) -> None:
    await asyncio.sleep(SLEEP_MS / 1000)
