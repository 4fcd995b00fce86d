"""The public Python SDK (DESIGN 9).

::

    from dtq import connect

    async with await connect("redis://localhost:6379/0") as q:
        task = await q.submit("echo_task", {"hello": "world"}, ttl_seconds=300)
        print((await q.get(task.task_id)).status)

``SyncQueue`` (``connect_sync``) is the same surface for scripts without an event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq import admin
from dtq.clock import redis_time_ms
from dtq.config import Settings, load_settings
from dtq.errors import DtqError, InvalidTaskError, RedisUnavailableError
from dtq.models import HistoryEntry, SubmitRequest, Task, TaskStatus, ttl_delta_seconds
from dtq.scripts import Scripts
from dtq.store import Store, ms_to_dt

__all__ = ["Queue", "SyncQueue", "connect", "connect_sync"]

P = ParamSpec("P")
R = TypeVar("R")

_SUBMIT_OPTIONS = frozenset(
    {
        "queue",
        "priority",
        "delay_seconds",
        "schedule_at",
        "ttl",
        "ttl_seconds",
        "expires_at",
        "idempotency_key",
        "max_attempts",
        "timeout_ms",
        "metadata",
    }
)


def _redis_errors(
    fn: Callable[P, Awaitable[R]],
) -> Callable[P, Awaitable[R]]:
    """Turn connection failures into RedisUnavailableError naming the URL."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            q = args[0]
            url = q.settings.redis_url if isinstance(q, Queue) else "?"
            raise RedisUnavailableError(
                f"Redis at {_safe_url(url)} is unreachable: {exc}", url=_safe_url(url)
            ) from None

    return wrapper


def _safe_url(url: str) -> str:
    """The URL without a password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


class Queue:
    """A producer's and operator's handle on dtq. Build it with :func:`connect`."""

    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        *,
        scripts: Scripts | None = None,
        known_types: Collection[str] | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.scripts = scripts or Scripts()
        self.known_types = known_types
        self.store = Store(redis, self.scripts, settings, known_types)

    # -- submit ---------------------------------------------------------------------------------

    def build_request(
        self, task_type: str, payload: Mapping[str, Any] | None, **options: Any
    ) -> SubmitRequest:
        """Validate one submission completely, without I/O."""
        unknown = set(options) - _SUBMIT_OPTIONS
        if unknown:
            raise InvalidTaskError(f"unknown submit option(s): {', '.join(sorted(unknown))}")
        ttl = options.pop("ttl", None)
        if ttl is not None:
            if options.get("ttl_seconds") is not None:
                raise InvalidTaskError("give only one of ttl and ttl_seconds")
            if options.get("expires_at") is not None:
                raise InvalidTaskError("give only one of expires_at and ttl")
            options["ttl_seconds"] = ttl_delta_seconds(ttl)
        fields = {k: v for k, v in options.items() if v is not None}
        return SubmitRequest.build(
            self.settings,
            self.known_types,
            task_type=task_type,
            payload=dict(payload) if payload is not None else {},
            **fields,
        )

    @_redis_errors
    async def submit(
        self,
        task_type: str,
        payload: Mapping[str, Any] | None = None,
        *,
        queue: str = "default",
        priority: int = 5,
        delay_seconds: float = 0,
        schedule_at: datetime | str | None = None,
        ttl: timedelta | None = None,
        ttl_seconds: float | None = None,
        expires_at: datetime | str | None = None,
        idempotency_key: str | None = None,
        max_attempts: int = 5,
        timeout_ms: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Task:
        """Submit one task. A replay of an idempotency key returns the stored task with
        ``duplicate=True``; errors are :class:`dtq.errors.DtqError` leaves."""
        req = self.build_request(
            task_type,
            payload,
            queue=queue,
            priority=priority,
            delay_seconds=delay_seconds,
            schedule_at=schedule_at,
            ttl=ttl,
            ttl_seconds=ttl_seconds,
            expires_at=expires_at,
            idempotency_key=idempotency_key,
            max_attempts=max_attempts,
            timeout_ms=timeout_ms,
            metadata=dict(metadata) if metadata is not None else None,
        )
        return await self.store.submit(req)

    @_redis_errors
    async def submit_many(
        self, tasks: Iterable[Mapping[str, Any]], **common: Any
    ) -> list[Task | DtqError]:
        """Submit many tasks in one round trip.

        Each item is a mapping with ``task_type``, ``payload`` and any option of :meth:`submit`;
        ``common`` options apply to every item that does not set them. Every item is validated
        before anything is sent (an invalid one raises). The result has one entry per item, in
        order: the task, or the error Redis refused it with (queue full, in progress).
        """
        reqs = []
        for item in tasks:
            opts = {**common, **item}
            task_type = opts.pop("task_type", None)
            if not isinstance(task_type, str):
                raise InvalidTaskError("each item needs a task_type")
            reqs.append(self.build_request(task_type, opts.pop("payload", None), **opts))
        return await self.store.submit_many(reqs)

    # -- reads ----------------------------------------------------------------------------------

    @_redis_errors
    async def get(self, task_id: str) -> Task:
        return await self.store.get(task_id)

    @_redis_errors
    async def list(
        self,
        *,
        queue: str | None = None,
        status: TaskStatus | str | None = None,
        task_type: str | None = None,
        limit: int = 50,
    ) -> builtins.list[Task]:
        st = TaskStatus(status) if status is not None else None
        return await self.store.list(queue=queue, status=st, task_type=task_type, limit=limit)

    @_redis_errors
    async def history(self, task_id: str) -> builtins.list[HistoryEntry]:
        return await self.store.history(task_id)

    @_redis_errors
    async def now(self) -> datetime:
        """The Redis server's clock: the one clock every dtq decision uses."""
        return ms_to_dt(await redis_time_ms(self.redis))

    # -- state changes --------------------------------------------------------------------------

    @_redis_errors
    async def cancel(self, task_id: str) -> Task:
        """Cancel a task that has not finished.

        Not started: CANCELLED at once. Running: cancellation is requested and
        :class:`dtq.errors.TaskRunningError` says so; the worker stops it within a second.
        Terminal: :class:`dtq.errors.TaskTerminalError`.
        """
        await admin.cancel(self.store, task_id)
        return await self.store.get(task_id)

    @_redis_errors
    async def mark_expired(self, task_id: str) -> Task:
        """Mark a task that has not started EXPIRED now; any other status is an error."""
        await admin.expire(self.store, task_id)
        return await self.store.get(task_id)

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def connect(
    url: str | None = None,
    *,
    settings: Settings | None = None,
    known_types: Collection[str] | None = None,
) -> Queue:
    """Connect to Redis and check it answers. ``known_types`` (if given) is the registry that
    submissions are checked against; without it any well-formed task_type is accepted."""
    settings = settings or load_settings()
    if url is not None:
        settings = settings.model_copy(update={"redis_url": url})
    redis = Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        health_check_interval=30,
        socket_connect_timeout=5,
    )
    queue = Queue(redis, settings, known_types=known_types)
    try:
        await redis.ping()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        await redis.aclose()
        raise RedisUnavailableError(
            f"Redis at {_safe_url(settings.redis_url)} is unreachable: {exc}",
            url=_safe_url(settings.redis_url),
        ) from None
    return queue


class SyncQueue:
    """Blocking facade over :class:`Queue` for scripts: same methods, no ``await``."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self._queue = self._runner.run(connect(url, **kwargs))

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._runner.run(getattr(self._queue, name)(*args, **kwargs))

    def submit(self, task_type: str, payload: Mapping[str, Any] | None = None, **kw: Any) -> Task:
        result: Task = self._run("submit", task_type, payload, **kw)
        return result

    def submit_many(
        self, tasks: Iterable[Mapping[str, Any]], **common: Any
    ) -> builtins.list[Task | DtqError]:
        result: builtins.list[Task | DtqError] = self._run("submit_many", list(tasks), **common)
        return result

    def get(self, task_id: str) -> Task:
        result: Task = self._run("get", task_id)
        return result

    def list(self, **filters: Any) -> builtins.list[Task]:
        result: builtins.list[Task] = self._run("list", **filters)
        return result

    def history(self, task_id: str) -> builtins.list[HistoryEntry]:
        result: builtins.list[HistoryEntry] = self._run("history", task_id)
        return result

    def now(self) -> datetime:
        result: datetime = self._run("now")
        return result

    def cancel(self, task_id: str) -> Task:
        result: Task = self._run("cancel", task_id)
        return result

    def mark_expired(self, task_id: str) -> Task:
        result: Task = self._run("mark_expired", task_id)
        return result

    def close(self) -> None:
        self._runner.run(self._queue.close())
        self._runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_sync(url: str | None = None, **kwargs: Any) -> SyncQueue:
    return SyncQueue(url, **kwargs)
