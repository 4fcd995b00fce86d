"""The demo task types (contract section 14). Synthetic data only: no shell, no network
beyond the Redis dtq already uses, no real data.

Run them: ``dtq worker run --tasks examples.tasks`` (the default task module), then
``dtq submit --type echo_task --payload '{"hello": "world"}'``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from dtq_tasks import RetryableError, TaskContext, task

COUNTER_TTL_S = 86_400


class SleepPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = Field(default=1.0, ge=0, le=30)


class FibonacciPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(default=25, ge=0, le=35)


class FlakyPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail_times: int = Field(default=2, ge=0, le=100)


class CounterPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class SlowPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = Field(default=5.0, ge=0, le=3600)


@task("echo_task")
async def echo_task(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Return the payload unchanged."""
    return payload


@task("sleep_task", payload_model=SleepPayload)
async def sleep_task(payload: dict[str, Any], ctx: TaskContext) -> dict[str, float]:
    """Sleep ``seconds`` (at most 30, validated before the handler runs) without blocking."""
    await asyncio.sleep(payload["seconds"])
    return {"slept": payload["seconds"]}


def _fib(n: int) -> int:
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


@task("fibonacci_task", payload_model=FibonacciPayload)
def fibonacci_task(payload: dict[str, Any], ctx: TaskContext) -> dict[str, int]:
    """CPU-BOUND: the naive recursive Fibonacci number ``n`` (0..35).

    A sync handler, so it runs in a thread and holds the GIL while it computes: several of
    them in one process take turns. Use ``dtq worker run --processes N`` to use N cores.
    """
    return {"n": payload["n"], "value": _fib(payload["n"])}


@task("flaky_task", payload_model=FlakyPayload)
async def flaky_task(payload: dict[str, Any], ctx: TaskContext) -> dict[str, int]:
    """Fail (retryably) on the first ``fail_times`` attempts, then succeed.

    Attempts are counted by dtq (``ctx.attempt``), so it needs no state of its own; with
    ``max_attempts > fail_times`` it succeeds on attempt ``fail_times + 1``.
    """
    if ctx.attempt <= payload["fail_times"]:
        raise RetryableError(f"flaky failure on attempt {ctx.attempt} of {payload['fail_times']}")
    return {"succeeded_on_attempt": ctx.attempt}


@task("always_fail_task")
async def always_fail_task(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Fail retryably every time: retried until max_attempts, then dead-lettered."""
    raise RetryableError(f"always fails (attempt {ctx.attempt})")


@task("counter_task", payload_model=CounterPayload)
async def counter_task(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Atomically increment the demo counter ``demo:counter:<name>`` (Redis INCR).

    The Redis URL is read from DTQ_REDIS_URL when the task runs, not at import. The counter
    expires a day after its last increment.
    """
    url = os.environ.get("DTQ_REDIS_URL", "redis://localhost:6379/0")
    client = Redis.from_url(url, decode_responses=True)
    try:
        key = f"demo:counter:{payload['name']}"
        pipe = client.pipeline(transaction=True)
        pipe.incr(key)
        pipe.expire(key, COUNTER_TTL_S)
        value, _ = await pipe.execute()
    finally:
        await client.aclose()
    return {"name": payload["name"], "value": int(value)}


@task("slow_task", payload_model=SlowPayload)
def slow_task(payload: dict[str, Any], ctx: TaskContext) -> dict[str, float]:
    """Block a thread for ``seconds`` (default 5, at most an hour), in short steps.

    For watching long-running work: heartbeats keep its lease, a drain waits for it, and a
    cancel discards its result (the thread itself runs on to the end).
    """
    deadline = time.monotonic() + payload["seconds"]
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.05, left))
    return {"slept": payload["seconds"]}
