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
from dtq.admin import Audit
from dtq.clock import redis_time_ms
from dtq.config import Settings, load_settings, redact_url
from dtq.connection import use_hiredis_packing
from dtq.errors import ConfigError, DtqError, InvalidTaskError, RedisUnavailableError
from dtq.models import HistoryEntry, SubmitRequest, Task, TaskStatus, ttl_delta_seconds
from dtq.scripts import Scripts
from dtq.store import RECENT_CAP, Store, ms_to_dt
from dtq.views import AuditEntry, DeadLetter, QueueStats, WorkerInfo

__all__ = ["Audit", "Queue", "SyncQueue", "connect", "connect_sync"]

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
                f"Redis at {redact_url(url)} is unreachable: {exc}", url=redact_url(url)
            ) from None

    return wrapper


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
        # A non-mapping goes to validation as it is: dict() would turn [["a", 1]] into an
        # object, and raise a bare TypeError for [1, 2].
        body: Any = {} if payload is None else payload
        return SubmitRequest.build(
            self.settings,
            self.known_types,
            task_type=task_type,
            payload=dict(body) if isinstance(body, Mapping) else body,
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
            metadata=dict(metadata) if isinstance(metadata, Mapping) else metadata,
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
        try:
            st = TaskStatus(status) if status is not None else None
        except ValueError:
            valid = ", ".join(s.value for s in TaskStatus)
            raise InvalidTaskError(f"status {status!r} is not one of {valid}") from None
        if not 1 <= limit <= RECENT_CAP:
            raise InvalidTaskError(f"limit must be between 1 and {RECENT_CAP}, not {limit}")
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
    async def cancel(self, task_id: str, *, audit: Audit | None = None) -> Task:
        """Cancel a task that has not finished.

        Not started: CANCELLED at once. Running: cancellation is requested and
        :class:`dtq.errors.TaskRunningError` says so; the worker stops it within a second.
        Terminal: :class:`dtq.errors.TaskTerminalError`. ``audit``: see :class:`Audit`.
        """
        await admin.cancel(self.store, task_id, audit=audit)
        return await self.store.get(task_id)

    @_redis_errors
    async def mark_expired(self, task_id: str, *, audit: Audit | None = None) -> Task:
        """Mark a task that has not started EXPIRED now; any other status is an error."""
        await admin.expire(self.store, task_id, audit=audit)
        return await self.store.get(task_id)

    # -- dead letters ---------------------------------------------------------------------------

    @_redis_errors
    async def dlq_list(self, limit: int = 50) -> builtins.list[DeadLetter]:
        """The newest dead letters first."""
        return await admin.dlq_list(self.store, limit)

    @_redis_errors
    async def dlq_get(self, task_id: str) -> DeadLetter:
        """The task's dead-letter entry; :class:`dtq.errors.NotInDeadLetterError` if none."""
        return await admin.dlq_get(self.store, task_id)

    @_redis_errors
    async def requeue_dead_letter(self, task_id: str, *, audit: Audit | None = None) -> Task:
        """Requeue a dead-lettered task: QUEUED, attempt 0, earlier attempts kept in
        ``metadata.previous_attempts``, its DLQ entry removed."""
        return await admin.dlq_requeue(self.store, task_id, audit=audit)

    @_redis_errors
    async def discard_dead_letter(self, task_id: str, *, audit: Audit | None = None) -> Task:
        """Remove the task's DLQ entry; the task stays DEAD_LETTERED with
        ``metadata.discarded = true``. Returns the task as it is now."""
        await admin.dlq_discard(self.store, task_id, audit=audit)
        return await self.store.get(task_id)

    @_redis_errors
    async def purge_dead_letters(self, *, audit: Audit | None = None) -> int:
        """Empty the DLQ; returns how many entries were removed."""
        return await admin.dlq_purge(self.store, audit=audit)

    # -- queues ---------------------------------------------------------------------------------

    @_redis_errors
    async def pause_queue(self, queue: str, *, audit: Audit | None = None) -> bool:
        """Stop workers from taking the queue's tasks; True if it was not paused already."""
        return await admin.set_paused(self.store, queue, True, audit=audit)

    @_redis_errors
    async def resume_queue(self, queue: str, *, audit: Audit | None = None) -> bool:
        """Let workers take the queue's tasks again; True if it was paused."""
        return await admin.set_paused(self.store, queue, False, audit=audit)

    @_redis_errors
    async def purge_queue(self, queue: str, *, audit: Audit | None = None) -> int:
        """Cancel every task of the queue that has not started; returns how many."""
        return await admin.purge_queue(self.store, queue, audit=audit)

    @_redis_errors
    async def queue_stats(self, queue: str) -> QueueStats:
        return await admin.queue_stats(self.store, queue)

    @_redis_errors
    async def all_queue_stats(self) -> builtins.list[QueueStats]:
        return await admin.all_queue_stats(self.store)

    # -- workers and audit ----------------------------------------------------------------------

    @_redis_errors
    async def workers(self) -> builtins.list[WorkerInfo]:
        return await admin.workers(self.store)

    @_redis_errors
    async def worker(self, worker_id: str) -> WorkerInfo:
        """One worker; :class:`dtq.errors.WorkerNotFoundError` if its hash is gone."""
        return await admin.worker(self.store, worker_id)

    @_redis_errors
    async def audit_log(self, limit: int = 50) -> builtins.list[AuditEntry]:
        """The newest operator actions first."""
        return await admin.audit_log(self.store, limit)

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
    scripts: Scripts | None = None,
) -> Queue:
    """Connect to Redis and check it answers. ``known_types`` (if given) is the registry that
    submissions are checked against; without it any well-formed task_type is accepted.
    ``scripts``: a :class:`Scripts` of the caller's (e.g. with a metrics hook)."""
    settings = settings or load_settings()
    if url is not None:  # validated like DTQ_REDIS_URL (model_copy would skip the check)
        settings = load_settings(**{**settings.model_dump(), "redis_url": url})
    try:
        redis = use_hiredis_packing(
            Redis.from_url(
                settings.redis_url,
                decode_responses=True,
                health_check_interval=30,
                socket_connect_timeout=5,
            )
        )
    except ValueError as exc:  # e.g. a port that is not a number
        raise ConfigError(
            f"invalid configuration: DTQ_REDIS_URL={redact_url(settings.redis_url)!r}: {exc}"
        ) from None
    queue = Queue(redis, settings, scripts=scripts, known_types=known_types)
    try:
        await redis.ping()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        await redis.aclose()
        raise RedisUnavailableError(
            f"Redis at {redact_url(settings.redis_url)} is unreachable: {exc}",
            url=redact_url(settings.redis_url),
        ) from None
    return queue


class SyncQueue:
    """Blocking facade over :class:`Queue` for scripts: same methods, no ``await``."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        try:
            self._queue = self._runner.run(connect(url, **kwargs))
        except BaseException:
            self._runner.close()  # else the loop is left open (ResourceWarning at exit)
            raise

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

    def cancel(self, task_id: str, *, audit: Audit | None = None) -> Task:
        result: Task = self._run("cancel", task_id, audit=audit)
        return result

    def mark_expired(self, task_id: str, *, audit: Audit | None = None) -> Task:
        result: Task = self._run("mark_expired", task_id, audit=audit)
        return result

    def dlq_list(self, limit: int = 50) -> builtins.list[DeadLetter]:
        result: builtins.list[DeadLetter] = self._run("dlq_list", limit)
        return result

    def dlq_get(self, task_id: str) -> DeadLetter:
        result: DeadLetter = self._run("dlq_get", task_id)
        return result

    def requeue_dead_letter(self, task_id: str, *, audit: Audit | None = None) -> Task:
        result: Task = self._run("requeue_dead_letter", task_id, audit=audit)
        return result

    def discard_dead_letter(self, task_id: str, *, audit: Audit | None = None) -> Task:
        result: Task = self._run("discard_dead_letter", task_id, audit=audit)
        return result

    def purge_dead_letters(self, *, audit: Audit | None = None) -> int:
        result: int = self._run("purge_dead_letters", audit=audit)
        return result

    def pause_queue(self, queue: str, *, audit: Audit | None = None) -> bool:
        result: bool = self._run("pause_queue", queue, audit=audit)
        return result

    def resume_queue(self, queue: str, *, audit: Audit | None = None) -> bool:
        result: bool = self._run("resume_queue", queue, audit=audit)
        return result

    def purge_queue(self, queue: str, *, audit: Audit | None = None) -> int:
        result: int = self._run("purge_queue", queue, audit=audit)
        return result

    def queue_stats(self, queue: str) -> QueueStats:
        result: QueueStats = self._run("queue_stats", queue)
        return result

    def all_queue_stats(self) -> builtins.list[QueueStats]:
        result: builtins.list[QueueStats] = self._run("all_queue_stats")
        return result

    def workers(self) -> builtins.list[WorkerInfo]:
        result: builtins.list[WorkerInfo] = self._run("workers")
        return result

    def worker(self, worker_id: str) -> WorkerInfo:
        result: WorkerInfo = self._run("worker", worker_id)
        return result

    def audit_log(self, limit: int = 50) -> builtins.list[AuditEntry]:
        result: builtins.list[AuditEntry] = self._run("audit_log", limit)
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
