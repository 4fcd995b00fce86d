"""The records an operator reads (through :mod:`dtq.admin`): dead letters, queue statistics,
workers, audit entries.

Pure models built from Redis hashes and stream entries; they never raise on a foreign or
malformed entry (a field that cannot be read takes a neutral default). Two rules live here
once, for every reader (the admin reads, the API's gauges, the scheduler leader):

- a queue's **depth and pending** (:func:`queue_depth`): the sums of ``XLEN`` and ``XPENDING``
  over its ten streams, plus the tasks a fair queue holds back from them (docs/limits.md), read
  by :func:`read_depth`;
- a worker's **liveness** (:func:`worker_liveness`): stale past :data:`STALE_HEARTBEATS`
  heartbeat intervals or when its hash is gone; alive when not stale and not stopped; a worker
  that has not written its first heartbeat yet is alive (its hash has a TTL of its own).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field
from redis.exceptions import ClusterDownError, ResponseError, TryAgainError

from dtq import keys
from dtq.models import parse_ts

__all__ = [
    "DEPTH_READS",
    "LIVENESS_FIELDS",
    "STALE_HEARTBEATS",
    "AuditEntry",
    "DeadLetter",
    "Liveness",
    "QueueStats",
    "WorkerInfo",
    "heartbeat_ms",
    "queue_depth",
    "read_depth",
    "stale_after_ms",
    "worker_liveness",
]

STALE_HEARTBEATS = 3
"""A worker is stale once its last heartbeat is older than this many heartbeat intervals
(contract section 6); its hash expires at the same age."""

LIVENESS_FIELDS = ("last_heartbeat_ms", "last_heartbeat", "status")
"""The worker hash fields :func:`worker_liveness` reads (``HMGET`` them, or pass the whole hash)."""

DEPTH_READS = 2 * len(keys.PRIORITIES) + 1
"""Replies :func:`read_depth` adds to a pipeline for one queue."""


def _int_field(value: str | None, default: int = 0) -> int:
    """A counter or id stored as a hash/stream string; ``default`` when absent or malformed."""
    try:
        return int(float(value)) if value not in (None, "") else default
    except (TypeError, ValueError):
        return default


def _json_field(value: str | None) -> Any:
    """A JSON field; the raw string when it is not JSON (never raises on a foreign entry)."""
    if not value:
        return {}
    try:
        return json.loads(value)
    except ValueError:
        return value


def read_depth(pipe: Any, queue: str) -> None:
    """Add ``XLEN`` and ``XPENDING`` of each of ``queue``'s streams, then the ``ZCARD`` of its
    held tasks, to ``pipe`` (a pipeline run with ``raise_on_error=False``): :data:`DEPTH_READS`
    replies for :func:`queue_depth`."""
    for stream in keys.queue_streams(queue):
        pipe.xlen(stream)
        pipe.xpending(stream, keys.CONSUMER_GROUP)
    pipe.zcard(keys.fair_held(queue))


def queue_depth(replies: Sequence[Any]) -> tuple[int, int]:
    """(depth, pending) of one queue from the replies of :func:`read_depth`: the entries in its
    streams (waiting + in flight, DESIGN 3) plus the tasks held back by fairness (waiting too),
    and those delivered and not acknowledged. A stream
    or group that does not exist yet answers an error: it counts 0. A reply that says the read
    did not happen (a lost connection, a cluster answering CLUSTERDOWN or TRYAGAIN during a
    failover) is raised: a queue is never reported empty for want of an answer."""
    for reply in replies:
        if isinstance(reply, (ClusterDownError, TryAgainError)) or (
            isinstance(reply, Exception) and not isinstance(reply, ResponseError)
        ):
            raise reply
    streams = replies[: 2 * len(keys.PRIORITIES)]
    depth = sum(int(n) for n in (*streams[0::2], replies[-1]) if not isinstance(n, Exception))
    pending = 0
    for reply in streams[1::2]:
        if reply and not isinstance(reply, Exception):
            pending += int(reply["pending"])
    return depth, pending


def stale_after_ms(heartbeat_interval_s: float) -> int:
    """The heartbeat age past which a worker is stale (:data:`STALE_HEARTBEATS` intervals)."""
    return round(STALE_HEARTBEATS * heartbeat_interval_s * 1000)


def heartbeat_ms(h: Mapping[str, str | None]) -> int | None:
    """The last heartbeat of a worker hash in epoch ms: ``last_heartbeat_ms``, else the
    contract's ISO ``last_heartbeat``; None when it has none (yet) or it cannot be read."""
    beat_ms = _int_field(h.get("last_heartbeat_ms"), -1)
    if beat_ms < 0 and h.get("last_heartbeat"):
        beat = parse_ts(h["last_heartbeat"])
        beat_ms = round(beat.timestamp() * 1000) if beat is not None else -1
    return beat_ms if beat_ms >= 0 else None


@dataclass(frozen=True)
class Liveness:
    """How an observer judges a worker (contract section 6: stale is never self-reported)."""

    alive: bool
    stale: bool
    beat_ms: int | None  # its last heartbeat (None: none written yet, or its hash is gone)
    age_ms: int | None  # now - beat_ms on the Redis clock


def worker_liveness(h: Mapping[str, str | None] | None, now_ms: int, stale_ms: int) -> Liveness:
    """The one liveness rule. ``h``: the worker hash's fields (at least
    :data:`LIVENESS_FIELDS`), None or empty when the hash is gone; ``now_ms`` on the Redis
    clock; ``stale_ms`` from :func:`stale_after_ms`.

    - hash gone: stale (a listed id whose hash expired), not alive;
    - heartbeat older than ``stale_ms``: stale, not alive;
    - no heartbeat written yet: a worker starting, alive;
    - ``status`` stopped: not alive (and not stale while its heartbeat is young).
    """
    if not h:
        return Liveness(alive=False, stale=True, beat_ms=None, age_ms=None)
    beat_ms = heartbeat_ms(h)
    age_ms = None if beat_ms is None else now_ms - beat_ms
    stale = age_ms is not None and age_ms > stale_ms
    alive = not stale and h.get("status") != "stopped"
    return Liveness(alive=alive, stale=stale, beat_ms=beat_ms, age_ms=age_ms)


class DeadLetter(BaseModel):
    """One entry of ``dtq:stream:dead-letter``: the task's stream fields plus the failure."""

    entry_id: str
    task_id: str
    queue: str
    original_queue: str
    task_type: str
    payload: Any
    attempt: int
    max_attempts: int
    priority: int
    timeout_ms: int
    idempotency_key: str | None = None
    failed_at: datetime | None = None
    failed_at_ms: int | None = None
    attempts_made: int
    last_error: str
    last_error_class: str
    retryable: bool
    worker_id: str | None = None

    @classmethod
    def from_entry(cls, entry_id: str, f: Mapping[str, str]) -> DeadLetter:
        failed_ms = _int_field(f.get("failed_at_ms"), -1)
        queue = f.get("queue") or f.get("original_queue") or ""
        return cls(
            entry_id=entry_id,
            task_id=f.get("task_id", ""),
            queue=queue,
            original_queue=f.get("original_queue") or queue,
            task_type=f.get("task_type", ""),
            payload=_json_field(f.get("payload")),
            attempt=_int_field(f.get("attempt")),
            max_attempts=_int_field(f.get("max_attempts")),
            priority=_int_field(f.get("priority")),
            timeout_ms=_int_field(f.get("timeout_ms")),
            idempotency_key=f.get("idempotency_key") or None,
            failed_at=datetime.fromtimestamp(failed_ms / 1000, tz=UTC) if failed_ms >= 0 else None,
            failed_at_ms=failed_ms if failed_ms >= 0 else None,
            attempts_made=_int_field(f.get("attempts_made")),
            last_error=f.get("last_error", ""),
            last_error_class=f.get("last_error_class", ""),
            retryable=f.get("retryable") in ("1", "true", "True"),
            worker_id=f.get("worker_id") or None,
        )


class QueueStats(BaseModel):
    """One queue's numbers; docs/operations-admin.md says which are exact and which are not."""

    queue: str
    depth: int
    pending: int
    waiting: int
    paused: bool
    retry_scheduled: int
    dlq_depth: int
    workers_active: int


class WorkerInfo(BaseModel):
    """A worker as its heartbeat hash ``dtq:worker:<id>`` describes it, judged by an observer.

    ``alive`` and ``stale`` are :func:`worker_liveness`'s; a worker never reports itself stale
    (contract section 6).
    """

    worker_id: str
    hostname: str = ""
    pid: int | None = None
    queues: list[str] = Field(default_factory=list)
    started_at: datetime | None = None
    last_heartbeat: datetime | None = None
    last_heartbeat_ms: int | None = None
    heartbeat_age_s: float | None = None
    active_tasks: int = 0
    concurrency: int = 0
    tasks_processed: int = 0
    tasks_failed: int = 0
    tasks_retried: int = 0
    status: str = ""
    alive: bool
    stale: bool

    @classmethod
    def from_hash(
        cls, worker_id: str, h: Mapping[str, str], now_ms: int, stale_ms: int
    ) -> WorkerInfo:
        live = worker_liveness(h, now_ms, stale_ms)
        beat_ms, age_ms = live.beat_ms, live.age_ms
        pid = _int_field(h.get("pid"), -1)
        return cls(
            worker_id=h.get("worker_id") or worker_id,
            hostname=h.get("hostname", ""),
            pid=pid if pid >= 0 else None,
            queues=_queue_list(h.get("queues", "")),
            started_at=parse_ts(h.get("started_at")),
            last_heartbeat=None
            if beat_ms is None
            else datetime.fromtimestamp(beat_ms / 1000, tz=UTC),
            last_heartbeat_ms=beat_ms,
            heartbeat_age_s=None if age_ms is None else max(0, age_ms) / 1000,
            active_tasks=_int_field(h.get("active_tasks")),
            concurrency=_int_field(h.get("concurrency")),
            tasks_processed=_int_field(h.get("tasks_processed")),
            tasks_failed=_int_field(h.get("tasks_failed")),
            tasks_retried=_int_field(h.get("tasks_retried")),
            status=h.get("status", ""),
            alive=live.alive,
            stale=live.stale,
        )


def _queue_list(raw: str) -> list[str]:
    """The worker's ``queues`` field: a JSON list or comma-separated names."""
    raw = raw.strip()
    if raw.startswith("["):
        value = _json_field(raw)
        if isinstance(value, list):
            return [str(q) for q in value]
    return [q.strip() for q in raw.split(",") if q.strip()]


class AuditEntry(BaseModel):
    """One operator action of ``dtq:stream:audit`` (contract section 13; ``queue`` is an
    extension naming the queue a queue-level action touched, and a task action's queue;
    ``schedule``, one naming the schedule of a schedule action, ``limit`` the limit of a limit
    action)."""

    entry_id: str
    actor: str
    action: str
    task_id: str | None = None
    queue: str | None = None
    ts: datetime
    request_id: str | None = None
    schedule: str | None = None  # extension: the schedule an action on one touched
    limit: str | None = None  # extension: the limit an action on one touched

    @classmethod
    def from_entry(cls, entry_id: str, f: Mapping[str, str]) -> AuditEntry:
        ts = parse_ts(f.get("ts")) or datetime.fromtimestamp(
            _int_field(entry_id.partition("-")[0]) / 1000, tz=UTC
        )
        return cls(
            entry_id=entry_id,
            actor=f.get("actor", ""),
            action=f.get("action", ""),
            task_id=f.get("task_id") or None,
            queue=f.get("queue") or None,
            ts=ts,
            request_id=f.get("request_id") or None,
            schedule=f.get("schedule") or None,
            limit=f.get("limit") or None,
        )
