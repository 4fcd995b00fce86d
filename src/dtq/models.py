"""The data model: statuses and their transitions, the task, the submit request, events.

Pure: no I/O, no clock. The Lua scripts check the same source states as ``TRANSITIONS``; a test
keeps the two in step.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from dtq.config import MAX_TIMEOUT_MS, Settings
from dtq.errors import InvalidTaskError, PayloadTooLargeError, UnknownTaskTypeError

__all__ = [
    "EVENT_TYPES",
    "METADATA_MAX_BYTES",
    "NOT_STARTED",
    "QUEUE_RE",
    "TERMINAL",
    "TRANSITIONS",
    "AuditEntry",
    "DeadLetter",
    "HistoryEntry",
    "QueueStats",
    "SubmitRequest",
    "Task",
    "TaskStatus",
    "WorkerInfo",
    "can_transition",
    "compact_json",
    "format_ts",
    "parse_ts",
    "ttl_delta_seconds",
]

METADATA_MAX_BYTES = 4096
QUEUE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
TASK_TYPE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")
IDEMPOTENCY_KEY_MAX = 256


class TaskStatus(StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    RETRYING = "retrying"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


S = TaskStatus
TERMINAL: frozenset[TaskStatus] = frozenset(
    {S.SUCCEEDED, S.FAILED, S.DEAD_LETTERED, S.CANCELLED, S.EXPIRED}
)
NOT_STARTED: frozenset[TaskStatus] = frozenset({S.PENDING, S.QUEUED, S.RETRYING})

# Contract section 1: the only allowed transitions. Terminal states have none.
TRANSITIONS: Mapping[TaskStatus, frozenset[TaskStatus]] = {
    S.PENDING: frozenset({S.QUEUED, S.CANCELLED, S.EXPIRED}),
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED, S.EXPIRED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.RETRYING, S.FAILED, S.DEAD_LETTERED, S.CANCELLED}),
    S.RETRYING: frozenset({S.QUEUED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.DEAD_LETTERED: frozenset(),
    S.CANCELLED: frozenset(),
    S.EXPIRED: frozenset(),
}

EVENT_TYPES = (
    "TASK_QUEUED",
    "TASK_STARTED",
    "TASK_SUCCEEDED",
    "TASK_FAILED",
    "TASK_RETRY_SCHEDULED",
    "TASK_RETRIED",
    "TASK_DEAD_LETTERED",
    "TASK_CANCELLED",
    "TASK_EXPIRED",
    "TASK_DUPLICATE_ABSORBED",
    "WORKER_STARTED",
    "WORKER_STOPPED",
    "WORKER_STALE",
    "CONFIGURATION_CHANGED",
)


def can_transition(src: TaskStatus, dst: TaskStatus) -> bool:
    """True when the contract allows ``src -> dst``."""
    return dst in TRANSITIONS[src]


def compact_json(value: Any) -> str:
    """The one JSON form dtq stores and measures (DESIGN 10)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def format_ts(ms: int) -> str:
    """Epoch milliseconds -> ISO 8601 UTC with milliseconds, as the Lua scripts write it."""
    dt = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def parse_ts(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _to_ms(dt: datetime) -> int:
    return round(dt.timestamp() * 1000)


class SubmitRequest(BaseModel):
    """Everything a producer may say about a new task; all of contract sections 1 and 13.

    Build it with :meth:`build`, which also applies the limits that depend on settings and
    the registry, and raises dtq's own errors instead of pydantic's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_type: str
    payload: dict[str, Any] = Field(default_factory=dict)
    queue: str = "default"
    idempotency_key: str | None = None
    max_attempts: int = Field(default=5, ge=1)
    priority: int = Field(default=5, ge=0, le=9)
    timeout_ms: int | None = Field(default=None, ge=1, le=MAX_TIMEOUT_MS)
    delay_seconds: float = Field(default=0, ge=0, le=10 * 365 * 86400)
    schedule_at: datetime | None = None
    expires_at: datetime | None = None
    ttl_seconds: float | None = Field(default=None, ge=0, le=10 * 365 * 86400)
    metadata: dict[str, Any] = Field(default_factory=dict)

    _payload_json: str = PrivateAttr(default="{}")
    _metadata_json: str = PrivateAttr(default="{}")

    @field_validator("task_type")
    @classmethod
    def _task_type(cls, value: str) -> str:
        if not TASK_TYPE_RE.fullmatch(value):  # fullmatch: "$" alone lets a final "\n" in
            raise ValueError("must be 1-128 characters: letters, digits, '_', '.', ':', '-'")
        return value

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str) -> str:
        if not QUEUE_RE.fullmatch(value):
            raise ValueError(f"must match {QUEUE_RE.pattern}")
        return value

    @field_validator("idempotency_key")
    @classmethod
    def _idem(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value or len(value) > IDEMPOTENCY_KEY_MAX or not value.isprintable():
            raise ValueError(f"must be 1-{IDEMPOTENCY_KEY_MAX} printable characters")
        return value

    @field_validator("schedule_at", "expires_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.utcoffset() is None:
            raise ValueError("must be timezone-aware (an ISO 8601 time with an offset, e.g. Z)")
        return value

    @field_validator("delay_seconds", "ttl_seconds")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator(
        "max_attempts", "priority", "timeout_ms", "delay_seconds", "ttl_seconds", mode="before"
    )
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        # pydantic's lax mode reads true as 1; a JSON boolean is never a count or a duration.
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        return value

    @model_validator(mode="after")
    def _exclusive(self) -> Self:
        meta_ttl = self.metadata.get("ttl_seconds")
        if meta_ttl is not None and (
            isinstance(meta_ttl, bool)
            or not isinstance(meta_ttl, int | float)
            or not math.isfinite(meta_ttl)
            or meta_ttl < 0
        ):
            raise ValueError("metadata.ttl_seconds must be a number >= 0")
        given = [
            name
            for name, v in (
                ("expires_at", self.expires_at),
                ("ttl_seconds", self.ttl_seconds),
                ("metadata.ttl_seconds", meta_ttl),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise ValueError(f"give only one of {' and '.join(given)}")
        if self.schedule_at is not None and self.delay_seconds:
            raise ValueError("give only one of delay_seconds and schedule_at")
        try:
            self._payload_json = compact_json(self.payload)
            self._metadata_json = compact_json(self.metadata)
            # Sizes are UTF-8 bytes: a lone surrogate (JSON "\ud800") cannot be stored or sent.
            self._payload_json.encode()
            self._metadata_json.encode()
        except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
            raise ValueError(f"payload and metadata must be JSON: {exc}") from None
        return self

    @classmethod
    def build(
        cls,
        settings: Settings,
        known_types: Collection[str] | None = None,
        **fields: Any,
    ) -> SubmitRequest:
        """Validate ``fields`` completely. ``known_types=None`` skips the registry check."""
        try:
            req = cls(**fields)
        except ValidationError as exc:
            raise InvalidTaskError(_describe(exc), errors=_error_list(exc)) from None
        req.check_limits(settings, known_types)
        return req

    def check_limits(self, settings: Settings, known_types: Collection[str] | None) -> None:
        if known_types is not None and self.task_type not in known_types:
            raise UnknownTaskTypeError(
                f"task_type {self.task_type!r} is not registered", task_type=self.task_type
            )
        size = len(self._payload_json.encode())
        if size > settings.max_payload_bytes:
            raise PayloadTooLargeError(
                f"payload is {size} bytes, the limit is {settings.max_payload_bytes}",
                size=size,
                limit=settings.max_payload_bytes,
            )
        meta_size = len(self._metadata_json.encode())
        if meta_size > METADATA_MAX_BYTES:
            raise InvalidTaskError(
                f"metadata is {meta_size} bytes, the limit is {METADATA_MAX_BYTES}",
                field="metadata",
            )
        if self.max_attempts > settings.max_attempts:
            raise InvalidTaskError(
                f"max_attempts {self.max_attempts} is above the cap DTQ_MAX_ATTEMPTS="
                f"{settings.max_attempts}",
                field="max_attempts",
            )

    @property
    def payload_json(self) -> str:
        return self._payload_json

    @property
    def metadata_json(self) -> str:
        return self._metadata_json

    def effective_ttl_ms(self) -> int | None:
        """TTL relative to ingest, in ms, from ttl_seconds or metadata.ttl_seconds."""
        ttl = self.ttl_seconds
        if ttl is None:
            ttl = self.metadata.get("ttl_seconds")
        return None if ttl is None else round(float(ttl) * 1000)

    def expires_at_ms(self) -> int | None:
        return None if self.expires_at is None else _to_ms(self.expires_at)

    def schedule_at_ms(self) -> int | None:
        return None if self.schedule_at is None else _to_ms(self.schedule_at)


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err.get("loc", ())) or "request"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{field}: {msg}"


def _error_list(exc: ValidationError) -> list[dict[str, str]]:
    return [
        {
            "field": ".".join(str(p) for p in e.get("loc", ())),
            "message": str(e.get("msg", "")).removeprefix("Value error, "),
        }
        for e in exc.errors()
    ]


class HistoryEntry(BaseModel):
    """One state change, as every script appends it to ``dtq:task:<id>:history``."""

    ts: datetime
    from_status: TaskStatus | None = Field(default=None, alias="from")
    to_status: TaskStatus = Field(alias="to")
    attempt: int = 0
    worker_id: str | None = None
    reason: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    model_config = ConfigDict(populate_by_name=True)

    @classmethod
    def from_json(cls, raw: str) -> HistoryEntry:
        data = json.loads(raw)
        details = {
            k: data.pop(k) for k in list(data) if k not in {"ts", "from", "to", "attempt", "reason"}
        }
        worker = details.pop("worker_id", None) or None
        data["from"] = data.get("from") or None
        return cls(**data, worker_id=worker, details=details)


class Task(BaseModel):
    """A task as stored in ``dtq:task:<task_id>``, with its execution metadata."""

    task_id: str
    idempotency_key: str | None = None
    task_type: str
    payload: dict[str, Any]
    created_at: datetime
    available_at: datetime
    updated_at: datetime | None = None
    attempt: int
    max_attempts: int
    priority: int
    timeout_ms: int
    status: TaskStatus
    queue: str
    metadata: dict[str, Any]
    expires_at: datetime | None = None
    expired_at: datetime | None = None
    entry_id: str | None = None
    cancel_requested: bool = False
    started_at: datetime | None = None
    finished_at: datetime | None = None
    duration_ms: int | None = None
    worker_id: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    retryable: bool | None = None
    retry_delay_ms: int | None = None
    result: Any = None
    result_truncated: bool = False
    duplicate: bool = False

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    def is_expired_at(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @classmethod
    def from_hash(cls, h: Mapping[str, str], result: str | None = None) -> Task:
        def opt(name: str) -> str | None:
            v = h.get(name)
            return v if v else None

        def opt_int(name: str) -> int | None:
            v = opt(name)
            return None if v is None else int(v)

        retryable = opt("retryable")
        return cls(
            task_id=h["task_id"],
            idempotency_key=opt("idempotency_key"),
            task_type=h["task_type"],
            payload=json.loads(h.get("payload") or "{}"),
            created_at=h["created_at"],
            available_at=h.get("available_at") or h["created_at"],
            updated_at=opt("updated_at"),
            attempt=int(h.get("attempt") or 0),
            max_attempts=int(h["max_attempts"]),
            priority=int(h["priority"]),
            timeout_ms=int(h["timeout_ms"]),
            status=TaskStatus(h["status"]),
            queue=h["queue"],
            metadata=json.loads(h.get("metadata") or "{}"),
            expires_at=opt("expires_at"),
            expired_at=opt("expired_at"),
            entry_id=opt("entry_id"),
            cancel_requested=h.get("cancel_requested") == "1",
            started_at=opt("started_at"),
            finished_at=opt("finished_at"),
            duration_ms=opt_int("duration_ms"),
            worker_id=opt("worker_id"),
            error_class=opt("error_class"),
            error_message=opt("error_message"),
            retryable=None if retryable is None else retryable == "1",
            retry_delay_ms=opt_int("retry_delay_ms"),
            result=json.loads(result) if result else None,
            result_truncated=h.get("result_truncated") == "1",
        )

    def public_dict(self) -> dict[str, Any]:
        """The JSON form the API and the CLI's --json show."""
        return self.model_dump(mode="json")


def ttl_delta_seconds(ttl: timedelta | float | None) -> float | None:
    """The SDK's ``ttl=timedelta`` as seconds."""
    if ttl is None:
        return None
    return ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)


# -- operator views (dtq.admin): dead letters, queue statistics, workers, audit entries ---------


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
            beat_ms = _to_ms(beat) if beat is not None else -1
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
