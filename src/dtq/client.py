"""The public Python SDK (DESIGN 9).

::

    from dtq import connect

    async with await connect("redis://localhost:6379/0") as q:
        task = await q.submit("echo_task", {"hello": "world"}, ttl_seconds=300)
        print((await q.get(task.task_id)).status)

``Queue`` is the one door into the core: the HTTP API and the CLI use it too, so each rule of
a submission (the body's validation, the registered task types, the payload models) and of a
read (queue names, list limits) is applied once, with one message, whoever asks. The options
of a submission are one typed list, :class:`dtq.models.SubmitOptions`.

``SyncQueue`` (``connect_sync``) is the same surface for scripts without an event loop; its
methods are made from ``Queue``'s, so they keep the same parameters.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Concatenate, Literal, ParamSpec, Self, TypeVar, Unpack

from pydantic import BaseModel
from redis.asyncio import Redis
from redis.exceptions import ClusterDownError, RedisClusterException, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq import admin, waits
from dtq.admin import limits as admin_limits
from dtq.admin import schedules as admin_schedules
from dtq.admin import workflows as admin_workflows
from dtq.admin.limits import Limit
from dtq.calls import Audit
from dtq.clock import redis_time_ms
from dtq.config import Settings, describe_redis, load_settings, redact_url
from dtq.connection import async_client, choose_events
from dtq.errors import (
    ConfigError,
    DtqError,
    InvalidTaskError,
    InvalidWorkflowError,
    RedisUnavailableError,
)
from dtq.keys import CONSUMER_GROUP, queue_streams
from dtq.limits import LimitDef
from dtq.models import (
    LIST_LIMIT_MAX,
    SUBMIT_OPTIONS,
    HistoryEntry,
    SubmitItem,
    SubmitOptions,
    SubmitRequest,
    Task,
    TaskStatus,
    check_list_limit,
    check_queue_name,
    check_status,
    ttl_delta_seconds,
)
from dtq.records import AuditEntry, DeadLetter, QueueStats, WorkerInfo
from dtq.schedules import HISTORY_CAP, Schedule, ScheduleDef
from dtq.scripts import Scripts
from dtq.store import Store, ms_to_dt
from dtq.workflows import Shape, Workflow, WorkflowSpec

__all__ = [
    "Audit",
    "Change",
    "Queue",
    "SubmitItem",
    "SubmitOptions",
    "SyncQueue",
    "connect",
    "connect_sync",
]

P = ParamSpec("P")
R = TypeVar("R")


def _redis_errors(
    fn: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn connection failures into RedisUnavailableError naming the URL, and a Redis
    Cluster's refusals to run a command for now too (CLUSTERDOWN while a failover is under way,
    TRYAGAIN during a slot migration: the command did not run), and a cluster whose slot map
    the client cannot get whole."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except (
            RedisConnectionError,
            RedisTimeoutError,
            OSError,
            ClusterDownError,
            TryAgainError,
            RedisClusterException,  # no node gave a slot map covering every slot
        ) as exc:
            q = args[0]
            where = describe_redis(q.settings) if isinstance(q, Queue) else "?"
            raise RedisUnavailableError(
                f"Redis at {where} is unreachable: {exc}", url=where
            ) from None

    return wrapper


async def _unavailable_as_dtq(q: Queue, it: AsyncIterator[R]) -> AsyncIterator[R]:
    """``it`` with :func:`_redis_errors`' translation of connection failures."""
    try:
        async for item in it:
            yield item
    except (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, TryAgainError,
            RedisClusterException) as exc:  # fmt: skip
        where = describe_redis(q.settings)
        raise RedisUnavailableError(f"Redis at {where} is unreachable: {exc}", url=where) from None


@dataclass(frozen=True)
class Change:
    """What an operator's state change did: the task as it is now, and the status it left."""

    task: Task
    previous_status: TaskStatus


class Queue:
    """A producer's and operator's handle on dtq, and the one door into the core: the SDK, the
    HTTP API and the CLI all go through it, and it applies every rule of a submission and of a
    read once. Build it with :func:`connect`.

    ``known_types``: the registered task types (an unknown one is UNKNOWN_TASK_TYPE); None
    accepts any well-formed type. ``payload_models``: the payload model of each handler that
    declares one, checked at submit (the worker checks it again before running the handler).
    """

    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        *,
        scripts: Scripts | None = None,
        known_types: Collection[str] | None = None,
        payload_models: Mapping[str, type[BaseModel]] | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.scripts = scripts or Scripts()
        self.known_types = known_types
        self.payload_models: Mapping[str, type[BaseModel]] = dict(payload_models or {})
        self.store = Store(redis, self.scripts, settings, known_types)
        self._wait_hub: waits.WaitHub | None = None

    def _waits(self) -> waits.WaitHub:
        """This queue's waits (made at the first, in the event loop that waits)."""
        if self._wait_hub is None:
            self._wait_hub = waits.WaitHub(self.store)
        return self._wait_hub

    # -- submit ---------------------------------------------------------------------------------

    def parse_request(self, fields: Mapping[str, Any]) -> SubmitRequest:
        """Validate one submission given as the fields of the HTTP body (``task_type``,
        ``payload`` and the options but ``ttl``), completely and without I/O."""
        return SubmitRequest.build(self.settings, self.known_types, self.payload_models, **fields)

    def build_request(
        self,
        task_type: str,
        payload: Mapping[str, Any] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> SubmitRequest:
        """Validate one submission of :meth:`submit`'s arguments completely, without I/O."""
        return self._build(task_type, payload, options)

    def _build(
        self, task_type: object, payload: object, options: Mapping[str, Any]
    ) -> SubmitRequest:
        unknown = set(options) - SUBMIT_OPTIONS
        if unknown:
            raise InvalidTaskError(f"unknown submit option(s): {', '.join(sorted(unknown))}")
        fields = {k: v for k, v in options.items() if v is not None}
        ttl = fields.pop("ttl", None)
        if ttl is not None:
            if "ttl_seconds" in fields:
                raise InvalidTaskError("give only one of ttl and ttl_seconds")
            if "expires_at" in fields:
                raise InvalidTaskError("give only one of expires_at and ttl")
            fields["ttl_seconds"] = ttl_delta_seconds(ttl)
        metadata = fields.get("metadata")
        if isinstance(metadata, Mapping):
            fields["metadata"] = dict(metadata)
        # A non-mapping goes to validation as it is: dict() would turn [["a", 1]] into an
        # object, and raise a bare TypeError for [1, 2].
        body: Any = {} if payload is None else payload
        fields["payload"] = dict(body) if isinstance(body, Mapping) else body
        fields["task_type"] = task_type
        return self.parse_request(fields)

    @_redis_errors
    async def submit(
        self,
        task_type: str,
        payload: Mapping[str, Any] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> Task:
        """Submit one task; ``options`` are :class:`SubmitOptions` (defaults: queue
        ``default``, priority 5, max_attempts 5, timeout ``DTQ_TASK_TIMEOUT_MS``). A replay
        of an idempotency key returns the stored task with ``duplicate=True``; errors are
        :class:`dtq.errors.DtqError` leaves. With ``DTQ_SUBMIT_MIN_REPLICAS`` set, a task
        its replicas did not confirm in time raises
        :class:`dtq.errors.ReplicationTimeoutError` naming it (it was not rolled back)."""
        return await self.store.submit(self._build(task_type, payload, options))

    @_redis_errors
    async def submit_fields(self, fields: Mapping[str, Any]) -> Task:
        """Submit one task given as the fields of the HTTP body (see :meth:`parse_request`)."""
        return await self.store.submit(self.parse_request(fields))

    @_redis_errors
    async def submit_many(
        self, tasks: Iterable[SubmitItem], **common: Unpack[SubmitOptions]
    ) -> builtins.list[Task | DtqError]:
        """Submit many tasks in one round trip.

        Each item is a mapping with ``task_type``, ``payload`` and any option of :meth:`submit`;
        ``common`` options apply to every item that does not set them. Every item is validated
        before anything is sent (an invalid one raises). The result has one entry per item, in
        order: the task, or the error Redis refused it with (queue full, in progress), or
        :class:`dtq.errors.ReplicationTimeoutError` for an accepted task its replicas did not
        confirm in time (``DTQ_SUBMIT_MIN_REPLICAS``).
        """
        reqs = []
        for item in tasks:
            opts: dict[str, Any] = {**common, **item}
            task_type = opts.pop("task_type", None)
            if not isinstance(task_type, str):
                raise InvalidTaskError("each item needs a task_type")
            reqs.append(self._build(task_type, opts.pop("payload", None), opts))
        return await self.store.submit_many(reqs)

    # -- reads ----------------------------------------------------------------------------------

    @_redis_errors
    async def submit_workflow(
        self,
        workflow: WorkflowSpec | Shape | Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        audit: Audit | None = None,
    ) -> Workflow:
        """Submit a workflow (docs/workflows.md): a :class:`~dtq.workflows.Shape` built with
        ``node``/``chain``/``group``/``chord``, a :class:`~dtq.workflows.WorkflowSpec`, or its
        JSON form. Every node is checked as a submit would check its task (INVALID_WORKFLOW
        naming the node); the workflow is written in one step and its roots are queued."""
        if isinstance(workflow, Shape):
            workflow = workflow.spec(metadata)
        elif metadata is not None:
            raise InvalidWorkflowError("metadata is given with a Shape only")
        return await admin_workflows.submit_workflow(
            self.store,
            workflow,
            known_types=self.known_types,
            payload_models=self.payload_models,
            audit=audit,
        )

    @_redis_errors
    async def get_workflow(self, workflow_id: str) -> Workflow:
        """A workflow and the state of each of its nodes; WorkflowNotFoundError."""
        return await admin_workflows.get_workflow(self.store, workflow_id)

    @_redis_errors
    async def cancel_workflow(self, workflow_id: str, *, audit: Audit | None = None) -> Workflow:
        """Cancel a workflow's nodes that have not started and request the cancellation of the
        running ones; it ends ``cancelled`` once they have ended."""
        return await admin_workflows.cancel_workflow(self.store, workflow_id, audit=audit)

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
        """Recent tasks, newest first, filtered by queue, status and task type."""
        st = None if status is None else check_status(status)
        if queue is not None:
            check_queue_name(queue)
        limit = check_list_limit(limit)
        return await self.store.list(queue=queue, status=st, task_type=task_type, limit=limit)

    @_redis_errors
    async def history(self, task_id: str) -> builtins.list[HistoryEntry]:
        return await self.store.history(task_id)

    # -- waiting (docs/sdk.md, "Waiting for a task") ---------------------------------------
    # ``timeout`` is the wait's own deadline, which also bounds its retries of Redis errors
    # (ASYNC109 would have callers wrap the call in asyncio.timeout, which cancels instead).

    @_redis_errors
    async def wait(
        self,
        task_id: str,
        *,
        timeout: float = waits.DEFAULT_WAIT_S,  # noqa: ASYNC109
    ) -> Task:
        """The task once it is terminal (succeeded, failed, dead_lettered, cancelled,
        expired). The end is pushed by the script that makes it (no polling); a Redis error
        is retried until ``timeout`` (seconds, at most :data:`dtq.waits.MAX_WAIT_S`) passes,
        then :class:`dtq.errors.WaitTimeout`. An unknown id, or one whose retention ran out,
        raises :class:`dtq.errors.TaskNotFoundError` at once."""
        (task,) = await waits.wait_many(self._waits(), [task_id], timeout)
        return task

    @_redis_errors
    async def result(
        self,
        task_id: str,
        *,
        timeout: float = waits.DEFAULT_WAIT_S,  # noqa: ASYNC109
    ) -> Any:
        """The handler's result once the task succeeded; raises :class:`dtq.errors.TaskFailed`
        (failed or dead-lettered: ``error_class``, ``error_message``),
        :class:`dtq.errors.TaskCancelled`, :class:`dtq.errors.TaskExpired`,
        :class:`dtq.errors.ResultExpired` (the result outlived DTQ_RESULT_RETENTION_S), or as
        :meth:`wait`."""
        return waits.result_of(await self.wait(task_id, timeout=timeout))

    @_redis_errors
    async def wait_many(
        self,
        task_ids: Iterable[str],
        *,
        timeout: float = waits.DEFAULT_WAIT_S,  # noqa: ASYNC109
    ) -> builtins.list[Task]:
        """Every task of ``task_ids`` once terminal, in the order given (each id once). One
        blocking read covers up to 500 tasks (per slot in the cluster layout).
        :class:`dtq.errors.WaitTimeout` when not all ended in time: its ``pending`` lists
        the ids still going."""
        return await waits.wait_many(self._waits(), task_ids, timeout)

    def as_completed(
        self, task_ids: Iterable[str], *, timeout: float = waits.DEFAULT_WAIT_S
    ) -> AsyncIterator[Task]:
        """The tasks of ``task_ids`` one by one as they end (``async for``); then
        :class:`dtq.errors.WaitTimeout` if some did not end in time."""
        return _unavailable_as_dtq(self, waits.as_completed(self._waits(), task_ids, timeout))

    @_redis_errors
    async def now(self) -> datetime:
        """The Redis server's clock: the one clock every dtq decision uses."""
        return ms_to_dt(await redis_time_ms(self.redis))

    # -- state changes --------------------------------------------------------------------------

    @_redis_errors
    async def cancel(self, task_id: str, *, audit: Audit | None = None) -> Task:
        """Cancel a task that has not finished; returns it as it is now.

        Not started: CANCELLED at once. Running: cancellation is requested and
        :class:`dtq.errors.TaskRunningError` says so; the worker stops it within a second.
        Terminal: :class:`dtq.errors.TaskTerminalError`. ``audit``: see :class:`Audit`.
        """
        return (await self.cancel_change(task_id, audit=audit)).task

    @_redis_errors
    async def cancel_change(self, task_id: str, *, audit: Audit | None = None) -> Change:
        """:meth:`cancel`, also saying which status the task was cancelled from."""
        previous = await admin.cancel(self.store, task_id, audit=audit)
        return Change(await self.store.get(task_id), TaskStatus(previous))

    @_redis_errors
    async def mark_expired(self, task_id: str, *, audit: Audit | None = None) -> Task:
        """Mark a task that has not started EXPIRED now; any other status is
        :class:`dtq.errors.InvalidTransitionError`. Returns the task as it is now."""
        return (await self.mark_expired_change(task_id, audit=audit)).task

    @_redis_errors
    async def mark_expired_change(self, task_id: str, *, audit: Audit | None = None) -> Change:
        """:meth:`mark_expired`, also saying which status the task expired from."""
        previous = await admin.expire(self.store, task_id, audit=audit)
        return Change(await self.store.get(task_id), TaskStatus(previous))

    # -- dead letters ---------------------------------------------------------------------------

    @_redis_errors
    async def dlq_list(self, limit: int = 50) -> builtins.list[DeadLetter]:
        """The newest dead letters first."""
        return await admin.dlq_list(self.store, check_list_limit(limit))

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

    @_redis_errors
    async def ensure_groups(self, queue: str = "default") -> None:
        """Create the consumer group on the queue's streams where it is missing."""
        await self.store.ensure_groups(check_queue_name(queue))

    @_redis_errors
    async def missing_groups(self, queue: str = "default") -> builtins.list[str]:
        """The streams of the queue that have no consumer group (a stream not created yet
        counts as one): what the API's readiness check reports."""
        pipe = self.redis.pipeline(transaction=False)
        streams = queue_streams(check_queue_name(queue))
        for stream in streams:
            pipe.xinfo_groups(stream)
        replies: builtins.list[Any] = await pipe.execute(raise_on_error=False)
        missing = []
        for stream, reply in zip(streams, replies, strict=True):
            if isinstance(reply, ResponseError):  # no such stream
                missing.append(stream)
            elif isinstance(reply, Exception):
                raise reply
            elif not any(g.get("name") == CONSUMER_GROUP for g in reply):
                missing.append(stream)
        return missing

    # -- periodic schedules (docs/schedules.md) -------------------------------------------------

    @_redis_errors
    async def put_schedule(
        self,
        name: str,
        /,
        definition: ScheduleDef | Mapping[str, Any] | None = None,
        *,
        audit: Audit | None = None,
        only: Literal["create", "update"] | None = None,
        **fields: Any,
    ) -> tuple[Schedule, str]:
        """Create or update schedule ``name`` (idempotent): a :class:`ScheduleDef`, or its
        fields as a mapping or as keyword arguments (``cron="0 7 * * *", tz="Europe/Paris",
        task_type="report"``). Returns the schedule and ``created``, ``updated`` or
        ``unchanged``. The template is checked as a submit of it would be, the task type
        against this client's registry when it has one. ``only="create"`` refuses a name that
        exists (:class:`dtq.errors.ScheduleExistsError`), ``only="update"`` one that does not
        (:class:`dtq.errors.ScheduleNotFoundError`)."""
        if definition is not None and fields:
            raise InvalidTaskError("give the definition or its fields, not both")
        return await admin_schedules.put_schedule(
            self.store,
            name,
            fields if definition is None else definition,
            audit=audit,
            known_types=self.known_types,
            payload_models=self.payload_models,
            only=only,
        )

    @_redis_errors
    async def get_schedule(self, name: str, *, history: int = HISTORY_CAP) -> Schedule:
        """Schedule ``name`` with its latest ``history`` decisions;
        :class:`dtq.errors.ScheduleNotFoundError` if there is none."""
        return await admin_schedules.get_schedule(self.store, name, history=history)

    @_redis_errors
    async def list_schedules(self, limit: int = LIST_LIMIT_MAX) -> builtins.list[Schedule]:
        """Every schedule, by next fire time (paused and ended ones last)."""
        return await admin_schedules.list_schedules(self.store, limit)

    @_redis_errors
    async def pause_schedule(self, name: str, *, audit: Audit | None = None) -> bool:
        """Stop schedule ``name`` from firing; True if it was not paused already."""
        return await admin_schedules.set_schedule_paused(self.store, name, True, audit=audit)

    @_redis_errors
    async def resume_schedule(self, name: str, *, audit: Audit | None = None) -> bool:
        """Let schedule ``name`` fire again, from where it was paused, its catch-up policy
        deciding which ticks of the pause fire; True if it was paused."""
        return await admin_schedules.set_schedule_paused(self.store, name, False, audit=audit)

    @_redis_errors
    async def delete_schedule(self, name: str, *, audit: Audit | None = None) -> None:
        """Delete schedule ``name`` and its keys (its tasks stay)."""
        await admin_schedules.delete_schedule(self.store, name, audit=audit)

    @_redis_errors
    async def trigger_schedule(
        self, name: str, *, key: str | None = None, audit: Audit | None = None
    ) -> Task:
        """Fire schedule ``name`` now, once per ``key`` (see
        :func:`dtq.admin.schedules.trigger_schedule`); returns the task."""
        return await admin_schedules.trigger_schedule(self.store, name, key=key, audit=audit)

    @_redis_errors
    async def next_fire_times(self, name: str, n: int = 10) -> builtins.list[datetime]:
        """The next ``n`` fire times of schedule ``name``."""
        return [ms_to_dt(ms) for ms in await admin_schedules.next_fire_times(self.store, name, n)]

    @_redis_errors
    async def preview_schedule(
        self, definition: ScheduleDef | Mapping[str, Any], n: int = 10
    ) -> builtins.list[datetime]:
        """The first ``n`` fire times a schedule of ``definition`` would have if it were
        created now (nothing is written)."""
        d = (
            definition.checked()
            if isinstance(definition, ScheduleDef)
            else ScheduleDef.parse(definition)
        )
        now = await redis_time_ms(self.redis)
        return [ms_to_dt(ms) for ms in admin_schedules.preview_definition(d, now, n)]

    # -- rate and concurrency limits (docs/limits.md) -------------------------------------------

    @_redis_errors
    async def put_limit(
        self,
        name: str,
        /,
        definition: LimitDef | Mapping[str, Any] | None = None,
        *,
        audit: Audit | None = None,
        **fields: Any,
    ) -> tuple[Limit, str]:
        """Create or update limit ``name``: a :class:`dtq.limits.LimitDef`, or its fields as a
        mapping or keyword arguments (``queue="payments", rate="100/s", concurrency=20``).
        Returns the limit and ``created``, ``updated`` or ``unchanged``; workers apply it
        within a second. A bad definition raises :class:`dtq.limits.LimitSpecError`."""
        if definition is not None and fields:
            raise InvalidTaskError("give the definition or its fields, not both")
        return await admin_limits.put_limit(
            self.store, name, fields if definition is None else definition, audit=audit
        )

    @_redis_errors
    async def get_limit(self, name: str) -> Limit:
        """Limit ``name`` with its use now; :class:`dtq.errors.LimitNotFoundError` if none."""
        return await admin_limits.get_limit(self.store, name)

    @_redis_errors
    async def list_limits(self) -> builtins.list[Limit]:
        """Every limit with its use now, by name."""
        return await admin_limits.list_limits(self.store)

    @_redis_errors
    async def delete_limit(self, name: str, *, audit: Audit | None = None) -> None:
        """Delete limit ``name`` (tasks running under it still free their places)."""
        await admin_limits.delete_limit(self.store, name, audit=audit)

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
        return await admin.audit_log(self.store, check_list_limit(limit))

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        if self._wait_hub is not None:
            await self._wait_hub.close()
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
    payload_models: Mapping[str, type[BaseModel]] | None = None,
    scripts: Scripts | None = None,
) -> Queue:
    """Connect to Redis and check it answers. ``known_types`` (if given) is the registry that
    submissions are checked against; without it any well-formed task_type is accepted.
    ``payload_models``: the handlers' payload models, checked at submit
    (``dtq_tasks.load_task_types`` gives both). ``scripts``: a :class:`Scripts` of the
    caller's (e.g. with a metrics hook)."""
    settings = settings or load_settings()
    if url is not None:  # validated like DTQ_REDIS_URL (model_copy would skip the check)
        settings = load_settings(**{**settings.model_dump(), "redis_url": url})
    try:
        redis = async_client(settings)
    except ValueError as exc:  # e.g. a port that is not a number
        raise ConfigError(
            f"invalid configuration: DTQ_REDIS_URL={redact_url(settings.redis_url)!r}: {exc}"
        ) from None
    queue = Queue(
        redis, settings, scripts=scripts, known_types=known_types, payload_models=payload_models
    )
    try:
        await redis.ping()
        await choose_events(redis)
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        await redis.aclose()
        where = describe_redis(settings)
        raise RedisUnavailableError(f"Redis at {where} is unreachable: {exc}", url=where) from None
    return queue


def _blocking(
    method: Callable[Concatenate[Queue, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[SyncQueue, P], R]:
    """``method`` of :class:`Queue` as a blocking method of :class:`SyncQueue`, with the same
    parameters (mypy checks every call against the async method's signature)."""

    @functools.wraps(method)
    def run(self: SyncQueue, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._runner.run(method(self._queue, *args, **kwargs))

    return run


class SyncQueue:
    """Blocking facade over :class:`Queue` for scripts: the same methods with the same
    parameters, no ``await``. ``SyncQueue(url, **kwargs)`` connects as :func:`connect` does."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        try:
            self._queue = self._runner.run(connect(url, **kwargs))
        except BaseException:
            self._runner.close()  # else the loop is left open (ResourceWarning at exit)
            raise

    submit = _blocking(Queue.submit)
    submit_fields = _blocking(Queue.submit_fields)
    submit_many = _blocking(Queue.submit_many)
    get = _blocking(Queue.get)
    submit_workflow = _blocking(Queue.submit_workflow)
    get_workflow = _blocking(Queue.get_workflow)
    cancel_workflow = _blocking(Queue.cancel_workflow)
    wait = _blocking(Queue.wait)
    result = _blocking(Queue.result)
    wait_many = _blocking(Queue.wait_many)
    list = _blocking(Queue.list)
    history = _blocking(Queue.history)
    now = _blocking(Queue.now)
    cancel = _blocking(Queue.cancel)
    cancel_change = _blocking(Queue.cancel_change)
    mark_expired = _blocking(Queue.mark_expired)
    mark_expired_change = _blocking(Queue.mark_expired_change)
    dlq_list = _blocking(Queue.dlq_list)
    dlq_get = _blocking(Queue.dlq_get)
    requeue_dead_letter = _blocking(Queue.requeue_dead_letter)
    discard_dead_letter = _blocking(Queue.discard_dead_letter)
    purge_dead_letters = _blocking(Queue.purge_dead_letters)
    pause_queue = _blocking(Queue.pause_queue)
    resume_queue = _blocking(Queue.resume_queue)
    purge_queue = _blocking(Queue.purge_queue)
    queue_stats = _blocking(Queue.queue_stats)
    all_queue_stats = _blocking(Queue.all_queue_stats)
    ensure_groups = _blocking(Queue.ensure_groups)
    missing_groups = _blocking(Queue.missing_groups)
    workers = _blocking(Queue.workers)
    worker = _blocking(Queue.worker)
    audit_log = _blocking(Queue.audit_log)
    put_schedule = _blocking(Queue.put_schedule)
    get_schedule = _blocking(Queue.get_schedule)
    list_schedules = _blocking(Queue.list_schedules)
    pause_schedule = _blocking(Queue.pause_schedule)
    resume_schedule = _blocking(Queue.resume_schedule)
    delete_schedule = _blocking(Queue.delete_schedule)
    trigger_schedule = _blocking(Queue.trigger_schedule)
    next_fire_times = _blocking(Queue.next_fire_times)
    preview_schedule = _blocking(Queue.preview_schedule)
    put_limit = _blocking(Queue.put_limit)
    get_limit = _blocking(Queue.get_limit)
    list_limits = _blocking(Queue.list_limits)
    delete_limit = _blocking(Queue.delete_limit)

    def as_completed(
        self, task_ids: Iterable[str], *, timeout: float = waits.DEFAULT_WAIT_S
    ) -> Iterator[Task]:
        """:meth:`Queue.as_completed`, blocking: a plain ``for`` loop."""
        it = self._queue.as_completed(task_ids, timeout=timeout)
        try:
            while True:
                try:
                    yield self._runner.run(_next(it))
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(it.aclose())  # type: ignore[attr-defined]

    def close(self) -> None:
        self._runner.run(self._queue.close())
        self._runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _next(it: AsyncIterator[R]) -> R:
    return await anext(it)


def connect_sync(url: str | None = None, **kwargs: Any) -> SyncQueue:
    return SyncQueue(url, **kwargs)
