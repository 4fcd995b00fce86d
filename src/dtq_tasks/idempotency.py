"""``idempotent_operation``: run a side effect once per key, for handler-level dedup (contract 15).

dtq delivers at least once: a handler may run again after a worker dies between its side
effect and the finish script. Wrap the side effect that must not repeat::

    from dtq_tasks import TaskContext, idempotent_operation, task

    @task("charge_card")
    async def charge_card(payload: dict, ctx: TaskContext) -> dict:
        redis = ...  # an async redis client of the application
        receipt = await idempotent_operation(
            redis,
            f"charge:{payload['order_id']}",  # one key per side effect, not per attempt
            86_400,                             # remember it for a day
            lambda: payments.charge(payload["order_id"], payload["amount"]),
        )
        return {"receipt": receipt}

The first caller wins ``SET NX`` on ``dtq:op:<key>`` and runs ``fn``; its JSON result is kept
for ``ttl`` seconds and every later call with the key returns that result without running
``fn``. While a first call is still running, another one raises :class:`RetryableError` (the
task retries later). If ``fn`` raises, the record is removed so a retry can run it again.

The limit (docs/delivery-guarantees.md): a process that dies *inside* ``fn`` leaves the record
"running" until ``ttl`` passes, because dtq cannot know whether the side effect happened; pick a
``ttl`` longer than any retry horizon, and make the side effect itself idempotent (an upstream
idempotency key) where that matters. With a sync client (``redis.Redis``) the call is plain
blocking, for sync handlers.
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from redis import Redis as SyncRedis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import WatchError

from dtq import keys
from dtq_tasks.errors import RetryableError

__all__ = ["idempotent_operation"]

T = TypeVar("T")

_MAX_CLAIM_TRIES = 3


@overload
def idempotent_operation(
    redis: AsyncRedis, key: str, ttl: int, fn: Callable[[], T | Awaitable[T]]
) -> Awaitable[T]: ...


@overload
def idempotent_operation(redis: SyncRedis, key: str, ttl: int, fn: Callable[[], T]) -> T: ...


def idempotent_operation(redis: Any, key: str, ttl: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` at most once per ``key`` within ``ttl`` seconds; see the module docstring.

    With an async client this returns an awaitable (``fn`` may be sync or async); with a sync
    client it runs at once and returns ``fn``'s (or the first run's stored) result.
    """
    if not isinstance(key, str) or not key or len(key) > 512 or not key.isprintable():
        raise ValueError("key must be 1-512 printable characters")
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0:
        raise ValueError(f"ttl must be a positive number of seconds, not {ttl!r}")
    if isinstance(redis, AsyncRedis):
        return _run_async(redis, key, ttl, fn)
    if isinstance(redis, SyncRedis):
        return _run_sync(redis, key, ttl, fn)
    raise TypeError(f"redis must be a redis.Redis or redis.asyncio.Redis, not {type(redis)!r}")


def _claim(token: str) -> str:
    return json.dumps({"state": "running", "token": token})


def _done(result: Any) -> str:
    try:
        return json.dumps({"state": "done", "result": result})
    except (TypeError, ValueError):  # kept as done: fn ran and must not run again
        return json.dumps({"state": "done", "result": None, "unserializable": True})


def _existing(key: str, raw: str | bytes | None) -> tuple[bool, Any]:
    """(found, stored result) for a record that someone else wrote; raises while running."""
    if raw is None:
        return False, None
    record = json.loads(raw)
    if record.get("state") == "done":
        return True, record.get("result")
    raise RetryableError(f"operation {key!r} is in progress elsewhere")


async def _run_async(redis: AsyncRedis, key: str, ttl: int, fn: Callable[[], Any]) -> Any:
    name = keys.operation(key)
    token = uuid.uuid4().hex
    for _ in range(_MAX_CLAIM_TRIES):
        if await redis.set(name, _claim(token), nx=True, ex=ttl):
            break
        found, result = _existing(key, await redis.get(name))
        if found:
            return result
    else:
        raise RetryableError(f"operation {key!r} could not be claimed")
    try:
        result = fn()
        if inspect.isawaitable(result):
            result = await result
    except BaseException:
        await _release_async(redis, name, token)
        raise
    await redis.set(name, _done(result), ex=ttl)
    return result


def _run_sync(redis: SyncRedis, key: str, ttl: int, fn: Callable[[], Any]) -> Any:
    name = keys.operation(key)
    token = uuid.uuid4().hex
    for _ in range(_MAX_CLAIM_TRIES):
        if redis.set(name, _claim(token), nx=True, ex=ttl):
            break
        found, result = _existing(key, redis.get(name))
        if found:
            return result
    else:
        raise RetryableError(f"operation {key!r} could not be claimed")
    try:
        result = fn()
    except BaseException:
        _release_sync(redis, name, token)
        raise
    redis.set(name, _done(result), ex=ttl)
    return result


def _ours(raw: str | bytes | None, token: str) -> bool:
    return raw is not None and json.loads(raw).get("token") == token


async def _release_async(redis: AsyncRedis, name: str, token: str) -> None:
    """Delete the claim if it is still ours (WATCH: a claim taken over is left alone)."""
    async with redis.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(name)
            if _ours(await pipe.get(name), token):
                pipe.multi()  # type: ignore[no-untyped-call]
                pipe.delete(name)
                await pipe.execute()
        except WatchError:
            pass


def _release_sync(redis: SyncRedis, name: str, token: str) -> None:
    with redis.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(name)  # type: ignore[no-untyped-call]
            if _ours(pipe.get(name), token):
                pipe.multi()
                pipe.delete(name)
                pipe.execute()
        except WatchError:
            pass
