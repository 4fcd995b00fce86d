"""Operator views read by :mod:`dtq.admin`: dead letters, queue statistics, workers, audit entries.

Pure models built from Redis hashes and stream entries; they never raise on a foreign or
malformed entry (a field that cannot be read takes a neutral default).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from dtq.models import parse_ts

__all__ = ["AuditEntry", "DeadLetter", "QueueStats", "WorkerInfo"]


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

    ``alive`` and ``stale`` come from the heartbeat's age on the Redis clock (stale: older than
    three heartbeat intervals); a worker never reports itself stale (contract section 6).
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
        cls, worker_id: str, h: Mapping[str, str], now_ms: int, stale_after_ms: int
    ) -> WorkerInfo:
        beat_ms = _int_field(h.get("last_heartbeat_ms"), -1)
        if beat_ms < 0 and h.get("last_heartbeat"):
            beat = parse_ts(h["last_heartbeat"])
            beat_ms = round(beat.timestamp() * 1000) if beat is not None else -1
        age_ms = now_ms - beat_ms if beat_ms >= 0 else None
        # No heartbeat written yet: the worker is starting (its hash has a TTL of its own).
        stale = age_ms is not None and age_ms > stale_after_ms
        status = h.get("status", "")
        pid = _int_field(h.get("pid"), -1)
        return cls(
            worker_id=h.get("worker_id") or worker_id,
            hostname=h.get("hostname", ""),
            pid=pid if pid >= 0 else None,
            queues=_queue_list(h.get("queues", "")),
            started_at=parse_ts(h.get("started_at")),
            last_heartbeat=datetime.fromtimestamp(beat_ms / 1000, tz=UTC) if beat_ms >= 0 else None,
            last_heartbeat_ms=beat_ms if beat_ms >= 0 else None,
            heartbeat_age_s=None if age_ms is None else max(0, age_ms) / 1000,
            active_tasks=_int_field(h.get("active_tasks")),
            concurrency=_int_field(h.get("concurrency")),
            tasks_processed=_int_field(h.get("tasks_processed")),
            tasks_failed=_int_field(h.get("tasks_failed")),
            tasks_retried=_int_field(h.get("tasks_retried")),
            status=status,
            alive=not stale and status != "stopped",
            stale=stale,
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
    extension naming the queue a queue-level action touched, and a task action's queue)."""

    entry_id: str
    actor: str
    action: str
    task_id: str | None = None
    queue: str | None = None
    ts: datetime
    request_id: str | None = None

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
        )
