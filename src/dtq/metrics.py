"""Prometheus metrics: every metric of contract section 9, the expiration metrics of issue 4,
and the gauges read from Redis at scrape time.

One :class:`Metrics` per process holds every family in its own registry (nothing is created at
import). Who counts what, each where the thing happens (``docs/operations.md`` has the table):

- the API: ``dtq_tasks_submitted_total``, ``dtq_task_ttl_seconds``, ``dtq_ingest_rejected_total``,
  a task expired at submit (ttl 0) and the cancels and expirations it performs;
- workers, through lifecycle hooks (:mod:`dtq.worker.telemetry`): starts, attempts, outcomes,
  latencies, retries scheduled, in-flight, start-time expirations;
- the scheduler leader (in a worker): retries promoted (``dtq_tasks_retried_total``) and tasks
  expired by the sweep or at promotion;
- both: ``dtq_redis_operations_total`` for script calls (``script:<name>``) and single commands
  (``xreadgroup``, ``xautoclaim``, ...).

Labels are only ``queue``, ``task_type``, ``status``, ``result``, ``worker_id``, ``operation``
and ``reason`` (:data:`LABEL_NAMES`); never a task id, payload or exception text. A queue or
task type that is not a valid name, or a task type this process does not know, is counted as
``(other)``, so label values stay a small, known set.

:class:`RedisGauges` (the API's ``/metrics``) reads queue depth and pending, the retry schedule,
the DLQ, workers and near-expiration in one pipelined round trip per scrape; see its docstring.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from threading import Thread
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from dtq import keys
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.models import QUEUE_RE, TASK_TYPE_RE

__all__ = [
    "ATTEMPT_RESULTS",
    "COMPLETED_STATUSES",
    "LABEL_NAMES",
    "OTHER",
    "REJECT_REASONS",
    "UNKNOWN",
    "Metrics",
    "MetricsServer",
    "RedisGauges",
    "count_commands",
    "task_labels",
]

log = logging.getLogger(__name__)

LABEL_NAMES = frozenset(
    {"queue", "task_type", "status", "result", "worker_id", "operation", "reason"}
)
COMPLETED_STATUSES = ("succeeded", "failed", "dead_lettered", "cancelled", "expired")
ATTEMPT_RESULTS = ("success", "failure", "timeout", "error")
REJECT_REASONS = {
    "INVALID_TASK": "invalid_task",
    "UNKNOWN_TASK_TYPE": "unknown_task_type",
    "PAYLOAD_TOO_LARGE": "payload_too_large",
    "QUEUE_FULL": "queue_full",
    "IDEMPOTENCY_IN_PROGRESS": "idempotency_in_progress",
}
OTHER = "(other)"  # an invalid or unregistered name: no queue or task type can be spelt so
UNKNOWN = "(unknown)"  # the request was refused before its queue could be read

# Seconds. Tasks run from milliseconds to the 1 h timeout cap; waits can be long under backlog.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1800.0, 3600.0,
)  # fmt: skip
RETRY_DELAY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 120.0, 300.0)
TTL_BUCKETS = (
    0.0, 1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 43200.0,
    86400.0, 604800.0,
)  # fmt: skip

OpHook = Callable[[str, bool], None]


def _queue(value: str | None) -> str:
    if value is None:
        return UNKNOWN
    return value if QUEUE_RE.fullmatch(value) else OTHER


class Metrics:
    """Every dtq metric family, in ``registry`` (a new one unless given), with the process's
    own ``process_*`` metrics (CPU, memory, open files; Linux).

    ``known_types``: the task types this process knows (its handler registry); another type is
    counted as ``(other)``. None accepts any well-formed type name.
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
        self.rejected = Counter(
            "dtq_ingest_rejected", "Submissions refused", ["queue", "reason"], registry=r
        )
        self._per_status = {
            "succeeded": self.succeeded,
            "failed": self.failed,
            "dead_lettered": self.dead_lettered,
            "expired": self.expired,
        }

    # -- label values ---------------------------------------------------------------------------

    def task_type(self, value: str | None) -> str:
        if not value or not TASK_TYPE_RE.fullmatch(value):
            return OTHER
        if self.known_types is not None and value not in self.known_types:
            return OTHER
        return value

    def _qt(self, queue: str | None, task_type: str | None) -> dict[str, str]:
        return {"queue": _queue(queue), "task_type": self.task_type(task_type)}

    # -- what happened --------------------------------------------------------------------------

    def task_submitted(self, queue: str, task_type: str, ttl_s: float | None = None) -> None:
        labels = self._qt(queue, task_type)
        self.submitted.labels(**labels).inc()
        if ttl_s is not None:
            self.ttl.labels(**labels).observe(max(0.0, ttl_s))

    def ingest_rejected(self, queue: str | None, code: str) -> None:
        """A submission refused with error ``code``; codes that are not a refusal of the
        submission itself (e.g. Redis unavailable) are not counted."""
        reason = REJECT_REASONS.get(code)
        if reason is not None:
            self.rejected.labels(queue=_queue(queue), reason=reason).inc()

    def task_started(self, queue: str, task_type: str, wait_s: float | None = None) -> None:
        labels = self._qt(queue, task_type)
        self.started.labels(**labels).inc()
        if wait_s is not None:
            self.wait.labels(**labels).observe(max(0.0, wait_s))

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
        labels = self._qt(queue, task_type)
        self.attempts.labels(**labels, result=result).inc()
        self.worker_tasks.labels(
            worker_id=worker_id, task_type=labels["task_type"], result=result
        ).inc()
        if execution_s is not None:
            self.execution.labels(**labels).observe(max(0.0, execution_s))

    def task_completed(
        self, queue: str, task_type: str, status: str, duration_s: float | None = None
    ) -> None:
        """A terminal status was recorded (by whoever recorded it)."""
        if status not in COMPLETED_STATUSES:
            raise ValueError(f"not a terminal status: {status!r}")
        labels = self._qt(queue, task_type)
        self.completed.labels(**labels, status=status).inc()
        per_status = self._per_status.get(status)
        if per_status is not None:
            per_status.labels(**labels).inc()
        if duration_s is not None:
            self.duration.labels(**labels).observe(max(0.0, duration_s))

    async def task_completed_by_id(self, redis: Redis, task_id: str, status: str) -> None:
        """A terminal status this process recorded for a task it knows only by id (API cancel
        and expire). A failure to read its labels is logged, never raised: the change is made."""
        try:
            labels = (await task_labels(redis, [task_id])).get(task_id)
        except (RedisError, OSError) as exc:
            log.warning("metrics: %s of task %s not counted: %s", status, task_id, exc)
            return
        if labels is not None:
            self.task_completed(*labels, status)

    def retry_scheduled(self, queue: str, task_type: str, delay_s: float) -> None:
        self.retry_delay.labels(**self._qt(queue, task_type)).observe(max(0.0, delay_s))

    def task_retried(self, queue: str, task_type: str) -> None:
        self.retried.labels(**self._qt(queue, task_type)).inc()

    def redis_op(self, operation: str, ok: bool) -> None:
        self.redis_ops.labels(operation=operation, result="ok" if ok else "error").inc()

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
        except (RedisError, OSError):
            hook(name, False)
            raise
        hook(name, True)
        return reply

    redis.execute_command = execute_command  # type: ignore[method-assign]


async def task_labels(redis: Redis, task_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """(queue, task_type) of each task whose hash still exists, in one round trip."""
    if not task_ids:
        return {}
    pipe = redis.pipeline(transaction=False)
    for tid in task_ids:
        pipe.hmget(keys.task(tid), "queue", "task_type")
    out = {}
    for tid, (queue, task_type) in zip(task_ids, await pipe.execute(), strict=True):
        if queue is not None:
            out[tid] = (str(queue), str(task_type or ""))
    return out


# -- Redis gauges --------------------------------------------------------------------------------

EXPIRING_CAP = 10_000
DEFAULT_QUEUE = "default"
STALE_HEARTBEATS = 3  # contract section 6


@dataclass
class Snapshot:
    """The values of one scrape."""

    depth: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    near_expiration: dict[str, int] = field(default_factory=dict)
    retry_scheduled: int = 0
    dlq_depth: int = 0
    workers_active: int = 0
    workers_stale: int = 0
    max_queue_depth: int = 0


@dataclass
class _Reads:
    """What the round trips of one scrape read."""

    now_ms: int
    queues: set[str]
    workers: set[str]
    scheduled: int
    dlq: int
    expiring: list[str]
    counts: dict[str, list[Any]]  # queue -> XLEN, XPENDING, ... of its ten streams
    beats: dict[str, Any]  # worker id -> last_heartbeat_ms (None: hash gone)


class RedisGauges:
    """A Prometheus collector of the values that live in Redis, read at scrape time.

    :meth:`refresh` (awaited by the API's ``/metrics`` before it renders) sends ONE pipeline:
    ``TIME``; ``SMEMBERS dtq:queues`` and ``dtq:workers``; ``ZCARD dtq:retry:schedule``;
    ``XLEN dtq:stream:dead-letter``; ``ZRANGEBYSCORE dtq:expiry -inf <now + window>`` (at most
    10,000 members); and, for every queue and worker known from the previous scrape, ``XLEN``
    and ``XPENDING`` of its ten streams and ``HGET last_heartbeat_ms`` of its hash. A second
    round trip happens only for what the first discovered: a queue or worker not seen before,
    or an expiring task whose queue is not known yet (a task's queue never changes, so it is
    looked up once while it stays in the window).

    ``dtq:expiry`` is one zset for all queues and holds only tasks that have not started
    (the start script removes a task's member, a retry puts it back), so near-expiration per
    queue counts the members due within ``DTQ_NEAR_EXPIRATION_S`` by their task's queue.
    Overdue members the sweep has not reached yet (within a second) are included. Past 10,000
    such members the counts cover the 10,000 soonest (a warning is logged).

    Workers: ``active`` have a heartbeat younger than three ``DTQ_HEARTBEAT_INTERVAL_S`` on the
    Redis clock (the API must use the workers' interval); ``stale`` are still listed in
    ``dtq:workers`` but older, or their hash is gone.

    If Redis fails, the gauges are left out of that scrape (the process's own metrics are
    still served) and ``dtq_redis_operations_total{operation="collect",result="error"}`` grows.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        on_op: OpHook | None = None,
        expiring_cap: int = EXPIRING_CAP,
        timeout_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.expiring_cap = expiring_cap
        self.timeout_s = timeout_s
        self.clock = RedisClock()
        self.round_trips = 0  # of the last refresh
        self._on_op = on_op
        self._synced = False
        self._queues: set[str] = {DEFAULT_QUEUE}
        self._workers: set[str] = set()
        self._task_queue: dict[str, str] = {}
        self._snapshot: Snapshot | None = None
        self._warned_cap = False
        self._lock = asyncio.Lock()

    async def refresh(self, redis: Redis) -> None:
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout_s):
                    self._snapshot = await self._read(redis)
            except (RedisError, OSError, TimeoutError) as exc:
                self._snapshot = None
                self._op(False)
                log.warning("metrics: Redis gauges not collected: %s", exc)
                return
            self._op(True)

    def _op(self, ok: bool) -> None:
        if self._on_op is not None:
            self._on_op("collect", ok)

    async def _read(self, redis: Redis) -> Snapshot:
        self.round_trips = 0
        if not self._synced:
            await self.clock.sync(redis)
            self._synced = True
        reads = await self._first_trip(redis)
        await self._discover(redis, reads)
        self._queues, self._workers = reads.queues, reads.workers
        known = self._task_queue
        self._task_queue = {t: known[t] for t in reads.expiring if t in known}
        return self._snapshot_of(reads)

    async def _first_trip(self, redis: Redis) -> _Reads:
        """The one pipeline of every scrape, for the queues and workers already known."""
        window_end = self.clock.now_ms() + self.settings.near_expiration_s * 1000
        queues, workers = sorted(self._queues), sorted(self._workers)
        pipe = redis.pipeline(transaction=False)
        pipe.time()
        pipe.smembers(keys.QUEUES)
        pipe.smembers(keys.WORKERS)
        pipe.zcard(keys.RETRY_SCHEDULE)
        pipe.xlen(keys.DEAD_LETTER)
        pipe.zrangebyscore(keys.EXPIRY, "-inf", window_end, start=0, num=self.expiring_cap)
        _queue_reads(pipe, queues)
        for wid in workers:
            pipe.hget(keys.worker(wid), "last_heartbeat_ms")
        before_ms = time.time() * 1000
        replies = await _execute(pipe)
        after_ms = time.time() * 1000
        self.round_trips += 1
        redis_time, queue_set, worker_set, scheduled, dlq, expiring = replies[:6]
        now_ms = int(redis_time[0]) * 1000 + int(redis_time[1]) // 1000
        self.clock.offset_ms = now_ms - (before_ms + after_ms) / 2
        rest = replies[6:]
        split = len(queues) * PER_QUEUE
        return _Reads(
            now_ms=now_ms,
            queues=set(queue_set) | {DEFAULT_QUEUE},
            workers=set(worker_set),
            scheduled=int(scheduled),
            dlq=int(dlq),
            expiring=[str(t) for t in expiring],
            counts=_per_queue(queues, rest[:split]),
            beats=dict(zip(workers, rest[split:], strict=True)),
        )

    async def _discover(self, redis: Redis, reads: _Reads) -> None:
        """A second round trip, only for queues, workers or expiring tasks not seen before."""
        new_queues = sorted(reads.queues - set(reads.counts))
        new_workers = sorted(reads.workers - set(reads.beats))
        unknown = [t for t in reads.expiring if t not in self._task_queue]
        if len(reads.expiring) >= self.expiring_cap and not self._warned_cap:
            self._warned_cap = True
            log.warning(
                "metrics: %d or more tasks expire within %ss: dtq_tasks_near_expiration "
                "counts the soonest %d",
                self.expiring_cap,
                self.settings.near_expiration_s,
                self.expiring_cap,
            )
        if not (new_queues or new_workers or unknown):
            return
        pipe = redis.pipeline(transaction=False)
        _queue_reads(pipe, new_queues)
        for wid in new_workers:
            pipe.hget(keys.worker(wid), "last_heartbeat_ms")
        for tid in unknown:
            pipe.hget(keys.task(tid), "queue")
        more = await _execute(pipe)
        self.round_trips += 1
        split = len(new_queues) * PER_QUEUE
        reads.counts.update(_per_queue(new_queues, more[:split]))
        beats, queues_of = more[split : split + len(new_workers)], more[split + len(new_workers) :]
        reads.beats.update(zip(new_workers, beats, strict=True))
        for tid, queue in zip(unknown, queues_of, strict=True):
            if queue is not None:
                self._task_queue[tid] = str(queue)

    def _snapshot_of(self, reads: _Reads) -> Snapshot:
        snap = Snapshot(
            retry_scheduled=reads.scheduled,
            dlq_depth=reads.dlq,
            max_queue_depth=self.settings.max_queue_depth,
        )
        for q in sorted(reads.queues):
            replies = reads.counts[q]
            snap.depth[q] = sum(int(n) for n in replies[0::2] if not isinstance(n, Exception))
            snap.pending[q] = sum(_pending(p) for p in replies[1::2])
            snap.near_expiration[q] = 0
        near = Tally(self._task_queue[t] for t in reads.expiring if t in self._task_queue)
        for q, n in near.items():
            snap.near_expiration[q] = snap.near_expiration.get(q, 0) + n
        limit_ms = STALE_HEARTBEATS * self.settings.heartbeat_interval_s * 1000
        for wid in reads.workers:
            beat = _int(reads.beats.get(wid))
            if beat is not None and reads.now_ms - beat <= limit_ms:
                snap.workers_active += 1
            else:
                snap.workers_stale += 1
        return snap

    # -- the collector side -----------------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return list(self._families(Snapshot()))

    def collect(self) -> Iterable[Metric]:
        if self._snapshot is None:
            return []
        return list(self._families(self._snapshot))

    @staticmethod
    def _families(s: Snapshot) -> Iterator[Metric]:
        def per_queue(name: str, doc: str, values: dict[str, int]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["queue"])
            for q, v in sorted(values.items()):
                g.add_metric([q], v)
            return g

        yield per_queue(
            "dtq_queue_depth", "Entries in the queue's streams (waiting + in flight)", s.depth
        )
        yield per_queue(
            "dtq_queue_pending", "Entries delivered and not acknowledged (XPENDING)", s.pending
        )
        yield per_queue(
            "dtq_tasks_near_expiration",
            "Waiting tasks whose deadline is within DTQ_NEAR_EXPIRATION_S",
            s.near_expiration,
        )
        yield GaugeMetricFamily(
            "dtq_retry_scheduled", "Members of dtq:retry:schedule", value=s.retry_scheduled
        )
        yield GaugeMetricFamily("dtq_dlq_depth", "Entries in the DLQ stream", value=s.dlq_depth)
        yield GaugeMetricFamily(
            "dtq_workers_active", "Workers with a fresh heartbeat", value=s.workers_active
        )
        yield GaugeMetricFamily(
            "dtq_workers_stale",
            "Workers still listed whose heartbeat is older than 3 intervals",
            value=s.workers_stale,
        )
        yield GaugeMetricFamily(
            "dtq_queue_max_depth",
            "DTQ_MAX_QUEUE_DEPTH of this API (admission limit per queue)",
            value=s.max_queue_depth,
        )


PER_QUEUE = 2 * len(keys.PRIORITIES)  # replies per queue: XLEN and XPENDING of each stream


def _per_queue(queues: Sequence[str], replies: Sequence[Any]) -> dict[str, list[Any]]:
    return {q: list(replies[i * PER_QUEUE : (i + 1) * PER_QUEUE]) for i, q in enumerate(queues)}


def _queue_reads(pipe: Any, queues: Sequence[str]) -> None:
    for q in queues:
        for stream in keys.queue_streams(q):
            pipe.xlen(stream)
            pipe.xpending(stream, keys.CONSUMER_GROUP)


async def _execute(pipe: Any) -> list[Any]:
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    for reply in replies:
        # XPENDING on a stream (or group) that does not exist yet answers an error: that is 0.
        if isinstance(reply, Exception) and not isinstance(reply, ResponseError):
            raise reply
    return replies


def _pending(reply: Any) -> int:
    if isinstance(reply, Exception) or not reply:
        return 0
    return int(reply["pending"])


def _int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


# -- the worker's endpoint -------------------------------------------------------------------------


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
