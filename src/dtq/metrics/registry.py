"""The metric families of a dtq process (:class:`Metrics`), the label rules, the hooks that
count Redis commands, and the worker's HTTP endpoint (:class:`MetricsServer`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from threading import Thread
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.metrics import MetricWrapperBase

from dtq.config import Settings
from dtq.metrics.redis_gauges import OpHook, RedisGauges
from dtq.models import QUEUE_RE, TASK_TYPE_RE

if TYPE_CHECKING:  # the clients are handed in; only the scrape-time gauges import redis
    from redis.asyncio import Redis

__all__ = [
    "ATTEMPT_RESULTS",
    "COMPLETED_STATUSES",
    "LABEL_NAMES",
    "OTHER",
    "REJECT_REASONS",
    "SCHEDULE_STATUSES",
    "UNKNOWN",
    "Metrics",
    "MetricsServer",
    "count_commands",
]


LABEL_NAMES = frozenset(
    {"queue", "task_type", "status", "result", "worker_id", "operation", "reason", "limit"}
)
COMPLETED_STATUSES = ("succeeded", "failed", "dead_lettered", "cancelled", "expired")
ATTEMPT_RESULTS = ("success", "failure", "timeout", "error")
# dtq_schedule_firings' status: a tick enqueued, skipped by the overlap policy, not fired by
# the catch-up policy, or refused by the queue (QUEUE_FULL: tried again).
SCHEDULE_STATUSES = ("fired", "skipped_overlap", "missed", "rejected")
REJECT_REASONS = {
    "INVALID_TASK": "invalid_task",
    "UNKNOWN_TASK_TYPE": "unknown_task_type",
    "PAYLOAD_TOO_LARGE": "payload_too_large",
    "QUEUE_FULL": "queue_full",
    "IDEMPOTENCY_IN_PROGRESS": "idempotency_in_progress",
}
OTHER = "(other)"  # an invalid or unregistered name: no queue or task type can be spelt so
LABEL_CACHE_MAX = 4096  # (queue, task_type) pairs whose label values are remembered
UNKNOWN = "(unknown)"  # the request was refused before its queue could be read

# Seconds. Tasks run from milliseconds to the 1 h timeout cap; waits can be long under backlog.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1800.0, 3600.0,
)  # fmt: skip
RETRY_DELAY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 120.0, 300.0)
# Seconds from a tick to its enqueue: milliseconds on the leader, TAKEOVER_MS after a stall.
THROTTLE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
SCHEDULE_LAG_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
TTL_BUCKETS = (
    0.0, 1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 43200.0,
    86400.0, 604800.0,
)  # fmt: skip


def _queue(value: str | None) -> str:
    if value is None:
        return UNKNOWN
    return value if QUEUE_RE.fullmatch(value) else OTHER


class Metrics:
    """Every dtq metric family, in ``registry`` (a new one unless given), with the process's
    own ``process_*`` metrics (CPU, memory, open files; Linux).

    ``known_types``: the task types this process knows (its handler registry); another type is
    counted as ``(other)``. None accepts any well-formed type name.

    A worker counts several series per task and per script call, so the labelled children are
    kept once made (``labels()`` validates and locks at every call): by family and label
    values, which are the checked, bounded ones; and the label values of the first
    :data:`LABEL_CACHE_MAX` raw (queue, task type) pairs seen, so a flood of made-up names
    cannot grow the cache.
    """

    def __init__(
        self,
        *,
        known_types: Collection[str] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.known_types = frozenset(known_types) if known_types is not None else None
        self.redis_gauges: RedisGauges | None = None
        r = self.registry
        if registry is None:
            ProcessCollector(registry=r)
        qt = ["queue", "task_type"]
        self.submitted = Counter("dtq_tasks_submitted", "Tasks accepted at ingest", qt, registry=r)
        self.started = Counter("dtq_tasks_started", "Executions started (RUNNING)", qt, registry=r)
        self.succeeded = Counter("dtq_tasks_succeeded", "Tasks ended SUCCEEDED", qt, registry=r)
        self.failed = Counter("dtq_tasks_failed", "Tasks ended FAILED", qt, registry=r)
        self.retried = Counter(
            "dtq_tasks_retried", "Retries promoted from the schedule (RETRYING -> QUEUED)", qt,
            registry=r,
        )  # fmt: skip
        self.dead_lettered = Counter(
            "dtq_tasks_dead_lettered", "Tasks ended DEAD_LETTERED", qt, registry=r
        )
        self.completed = Counter(
            "dtq_tasks_completed", "Tasks that reached a terminal status", [*qt, "status"],
            registry=r,
        )  # fmt: skip
        self.attempts = Counter(
            "dtq_task_attempts", "Executions ended, by result", [*qt, "result"], registry=r
        )
        self.expired = Counter("dtq_tasks_expired", "Tasks ended EXPIRED", qt, registry=r)
        self.worker_inflight = Gauge(
            "dtq_worker_inflight", "Tasks running in this worker", ["worker_id"], registry=r
        )
        self.worker_tasks = Counter(
            "dtq_worker_tasks", "Executions ended in this worker, by result",
            ["worker_id", "task_type", "result"], registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "dtq_task_duration_seconds", "End to end: created -> terminal finish", qt,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.execution = Histogram(
            "dtq_task_execution_seconds", "Handler run time of one execution", qt,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.wait = Histogram(
            "dtq_task_wait_seconds", "Created -> first start", qt, buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.retry_delay = Histogram(
            "dtq_retry_delay_seconds", "Delay of each retry scheduled", qt,
            buckets=RETRY_DELAY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttl = Histogram(
            "dtq_task_ttl_seconds", "TTL of tasks submitted with a deadline", qt,
            buckets=TTL_BUCKETS, registry=r,
        )  # fmt: skip
        self.redis_ops = Counter(
            "dtq_redis_operations", "Redis script calls and commands", ["operation", "result"],
            registry=r,
        )  # fmt: skip
        self.schedule_firings = Counter(
            "dtq_schedule_firings", "Schedule ticks decided, by decision", [*qt, "status"],
            registry=r,
        )  # fmt: skip
        self.schedule_lag = Histogram(
            "dtq_schedule_lag_seconds", "Tick -> its task enqueued, for each firing", qt,
            buckets=SCHEDULE_LAG_BUCKETS, registry=r,
        )  # fmt: skip
        self.throttled = Counter(
            "dtq_tasks_throttled", "Starts a rate or concurrency limit parked (docs/limits.md)",
            qt, registry=r,
        )  # fmt: skip
        self.throttle_wait = Histogram(
            "dtq_throttle_wait_seconds",
            "First park by a limit -> the start that ran the task, for each throttled task", qt,
            buckets=THROTTLE_WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.places_swept_total = Counter(
            "dtq_limit_places_swept",
            "Places of a concurrency limit given back by a worker's sweep: no running task held "
            "them (docs/limits.md)", ["queue", "limit"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "dtq_ingest_rejected", "Submissions refused", ["queue", "reason"], registry=r
        )
        self._per_status = {
            "succeeded": self.succeeded,
            "failed": self.failed,
            "dead_lettered": self.dead_lettered,
            "expired": self.expired,
        }
        self._qt_values: dict[tuple[str | None, str | None], tuple[str, str]] = {}
        self._children: dict[tuple[object, ...], Any] = {}

    # -- label values ---------------------------------------------------------------------------

    def task_type(self, value: str | None) -> str:
        if not value or not TASK_TYPE_RE.fullmatch(value):
            return OTHER
        if self.known_types is not None and value not in self.known_types:
            return OTHER
        return value

    def _qt(self, queue: str | None, task_type: str | None) -> tuple[str, str]:
        """The (queue, task_type) label values of a raw pair."""
        key = (queue, task_type)
        values = self._qt_values.get(key)
        if values is None:
            values = (_queue(queue), self.task_type(task_type))
            if len(self._qt_values) < LABEL_CACHE_MAX:
                self._qt_values[key] = values
        return values

    def _child(self, family: MetricWrapperBase, *values: str) -> Any:
        """``family.labels(*values)``, made once (values in the family's label order)."""
        key = (family, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*values)
        return child

    # -- what happened --------------------------------------------------------------------------

    def task_submitted(self, queue: str, task_type: str, ttl_s: float | None = None) -> None:
        qt = self._qt(queue, task_type)
        self._child(self.submitted, *qt).inc()
        if ttl_s is not None:
            self._child(self.ttl, *qt).observe(max(0.0, ttl_s))

    def ingest_rejected(self, queue: str | None, code: str) -> None:
        """A submission refused with error ``code``; codes that are not a refusal of the
        submission itself (e.g. Redis unavailable) are not counted."""
        reason = REJECT_REASONS.get(code)
        if reason is not None:
            self._child(self.rejected, _queue(queue), reason).inc()

    def task_started(self, queue: str, task_type: str, wait_s: float | None = None) -> None:
        qt = self._qt(queue, task_type)
        self._child(self.started, *qt).inc()
        if wait_s is not None:
            self._child(self.wait, *qt).observe(max(0.0, wait_s))

    def attempt_ended(
        self,
        queue: str,
        task_type: str,
        worker_id: str,
        result: str,
        execution_s: float | None = None,
    ) -> None:
        if result not in ATTEMPT_RESULTS:
            raise ValueError(f"unknown attempt result {result!r}")
        qt = self._qt(queue, task_type)
        self._child(self.attempts, *qt, result).inc()
        self._child(self.worker_tasks, worker_id, qt[1], result).inc()
        if execution_s is not None:
            self._child(self.execution, *qt).observe(max(0.0, execution_s))

    def task_completed(
        self, queue: str, task_type: str, status: str, duration_s: float | None = None
    ) -> None:
        """A terminal status was recorded (by whoever recorded it)."""
        if status not in COMPLETED_STATUSES:
            raise ValueError(f"not a terminal status: {status!r}")
        qt = self._qt(queue, task_type)
        self._child(self.completed, *qt, status).inc()
        per_status = self._per_status.get(status)
        if per_status is not None:
            self._child(per_status, *qt).inc()
        if duration_s is not None:
            self._child(self.duration, *qt).observe(max(0.0, duration_s))

    def retry_scheduled(self, queue: str, task_type: str, delay_s: float) -> None:
        self._child(self.retry_delay, *self._qt(queue, task_type)).observe(max(0.0, delay_s))

    def task_retried(self, queue: str, task_type: str) -> None:
        self._child(self.retried, *self._qt(queue, task_type)).inc()

    def schedule_decided(
        self, queue: str, task_type: str, status: str, n: int = 1, lag_s: float | None = None
    ) -> None:
        """``n`` ticks of a schedule decided as ``status`` (one of ``SCHEDULE_STATUSES``);
        ``lag_s``: for one fired tick, tick -> enqueue."""
        qt = self._qt(queue, task_type)
        self._child(self.schedule_firings, *qt, status).inc(n)
        if lag_s is not None:
            self._child(self.schedule_lag, *qt).observe(lag_s)

    def task_throttled(self, queue: str, task_type: str) -> None:
        self._child(self.throttled, *self._qt(queue, task_type)).inc()

    def throttle_waited(self, queue: str, task_type: str, wait_s: float) -> None:
        self._child(self.throttle_wait, *self._qt(queue, task_type)).observe(max(0.0, wait_s))

    def places_swept(self, queue: str, limit: str, n: int) -> None:
        self._child(self.places_swept_total, _queue(queue), limit).inc(n)

    def redis_op(self, operation: str, ok: bool) -> None:
        self._child(self.redis_ops, operation, "ok" if ok else "error").inc()

    def script_call(self, name: str, ok: bool) -> None:
        """The ``on_call`` hook of :class:`dtq.scripts.Scripts`."""
        self.redis_op(f"script:{name}", ok)

    def track_inflight(self, worker_id: str, count: Callable[[], int]) -> None:
        self.worker_inflight.labels(worker_id=worker_id).set_function(lambda: float(count()))

    # -- the API's Redis-derived gauges ---------------------------------------------------------

    def add_redis_gauges(self, settings: Settings) -> RedisGauges:
        """Register the scrape-time Redis gauges (once); :meth:`refresh` before each scrape."""
        if self.redis_gauges is None:
            self.redis_gauges = RedisGauges(settings, on_op=self.redis_op)
            self.registry.register(self.redis_gauges)
        return self.redis_gauges

    async def refresh(self, redis: Redis) -> None:
        if self.redis_gauges is not None:
            await self.redis_gauges.refresh(redis)


def count_commands(redis: Redis, hook: OpHook) -> None:
    """Report every command this client sends on its own (not in a pipeline) to ``hook`` as
    ``(lower-case command name, ok)``. Pipelines are not reported per command; the scripts
    they carry are, by :class:`dtq.scripts.Scripts`."""
    original: Callable[..., Awaitable[Any]] = redis.execute_command

    async def execute_command(*args: Any, **options: Any) -> Any:
        name = str(args[0]).lower() if args else "unknown"
        try:
            reply = await original(*args, **options)
        except Exception:  # refused, or Redis unavailable: a failed operation either way
            hook(name, False)
            raise
        hook(name, True)
        return reply

    redis.execute_command = execute_command  # type: ignore[method-assign]


class MetricsServer:
    """``/metrics`` of one registry on ``host:port`` (prometheus_client's threaded server)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd: WSGIServer
        self._thread: Thread
        self._httpd, self._thread = start_http_server(port, host, registry)
        self.host = host

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
