"""The data model: statuses and their transitions, the task, the submit options and request,
events, and the name and limit rules every surface applies.

Pure: no I/O, no clock. Every step the Lua scripts write to a task's history is in
``TRANSITIONS`` (or, where noted, in ``HISTORY_EXTENSIONS``), and every pair of both tables is
written by some script: ``tests/integration/test_transitions.py`` runs every script path on a
real server and checks both directions.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, NamedTuple, Required, Self, TypedDict, TypeVar

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
    "HISTORY_EXTENSIONS",
    "INITIAL",
    "LIST_LIMIT_MAX",
    "MAX_DELAY_S",
    "METADATA_MAX_BYTES",
    "NOT_STARTED",
    "PROGRESS_DATA_MAX_BYTES",
    "QUEUE_RE",
    "SUBMIT_OPTIONS",
    "TASK_ID_RE",
    "TERMINAL",
    "TRANSITIONS",
    "HistoryEntry",
    "Progress",
    "SubmitItem",
    "SubmitOptions",
    "SubmitRequest",
    "Task",
    "TaskStatus",
    "can_transition",
    "check_list_limit",
    "check_progress",
    "check_queue_name",
    "check_status",
    "compact_json",
    "format_ts",
    "parse_ts",
    "ttl_delta_seconds",
    "validate_payload",
]

METADATA_MAX_BYTES = 4096
QUEUE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
TASK_ID_RE = re.compile(r"[0-9a-f]{32}")  # what the store generates: a UUID4 as 32 hex digits
TASK_TYPE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")
IDEMPOTENCY_KEY_MAX = 256
MAX_DELAY_S = 10 * 365 * 86400  # delay_seconds, ttl_seconds and metadata.ttl_seconds: 10 years
LIST_LIMIT_MAX = 10_000  # most items one list read returns (tasks, dead letters, audit entries)

_ModelT = TypeVar("_ModelT", bound=BaseModel)


def check_queue_name(name: object) -> str:
    """``name`` when it is a queue name, else InvalidTaskError: the one rule and message of
    every surface (the SDK, the API's body, path and query, the CLI's flags, the worker)."""
    if isinstance(name, str) and QUEUE_RE.fullmatch(name):  # fullmatch: "$" lets a "\n" in
        return name
    raise InvalidTaskError(
        f"{name!r} is not a valid queue name: 1 to 64 of a-z, 0-9, '_' and '-', "
        "starting with a letter or digit",
        field="queue",
    )


def check_list_limit(limit: object) -> int:
    """``limit`` when it is a valid number of items for one list read, else InvalidTaskError."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidTaskError(
            f"limit must be between 1 and {LIST_LIMIT_MAX}, not {limit!r}", field="limit"
        )
    return limit


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


def check_status(status: str) -> TaskStatus:
    """``status`` (a TaskStatus or its value) as a TaskStatus, else InvalidTaskError naming
    the statuses there are."""
    try:
        return TaskStatus(status)
    except ValueError:
        valid = ", ".join(s.value for s in TaskStatus)
        raise InvalidTaskError(f"status {status!r} is not one of {valid}", field="status") from None


S = TaskStatus
TERMINAL: frozenset[TaskStatus] = frozenset(
    {S.SUCCEEDED, S.FAILED, S.DEAD_LETTERED, S.CANCELLED, S.EXPIRED}
)
NOT_STARTED: frozenset[TaskStatus] = frozenset({S.PENDING, S.QUEUED, S.RETRYING})

# Where a task's history starts (its first entry's `from` is null): PENDING when delayed, else
# QUEUED (a task expired at submit goes on at once to EXPIRED).
INITIAL: frozenset[TaskStatus] = frozenset({S.PENDING, S.QUEUED})

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

# History entries beyond the contract's table, each deliberate: an operator's DLQ requeue, the one
# documented way out of a terminal state (DEAD_LETTERED -> QUEUED, docs/operations-admin.md), and
# entries that record a step without a change of status: a crash redelivery's new attempt
# (RUNNING -> RUNNING, reason `redelivered`), a new entry for a task whose entry was removed
# outside dtq (QUEUED -> QUEUED and RUNNING -> RUNNING, reason `entry_lost`) and a DLQ discard or
# purge (DEAD_LETTERED -> DEAD_LETTERED). No status change other than TRANSITIONS and the
# requeue is ever written.
HISTORY_EXTENSIONS: Mapping[TaskStatus, frozenset[TaskStatus]] = {
    # QUEUED -> PENDING: a task over one of its limits, parked until it is due again
    # (docs/limits.md); its attempt is not counted.
    S.QUEUED: frozenset({S.QUEUED, S.PENDING}),
    # RUNNING -> PENDING: a handler that raised RateLimited, parked like a throttle; its attempt
    # is not spent (docs/limits.md, "Back-pressure from a handler").
    S.RUNNING: frozenset({S.RUNNING, S.PENDING}),
    S.DEAD_LETTERED: frozenset({S.QUEUED, S.DEAD_LETTERED}),
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
    # Deliberate extensions (docs/schedules.md): a schedule enqueued a tick's task, or decided
    # not to (overlap, missed ticks).
    "SCHEDULE_FIRED",
    "SCHEDULE_SKIPPED",
    # Deliberate extension (docs/handlers.md, "Progress"): a running handler's ctx.progress().
    "TASK_PROGRESS",
    # Deliberate extension (docs/limits.md): a task over one of its limits was parked.
    "TASK_THROTTLED",
    # Deliberate extensions (docs/workflows.md): a workflow was submitted, and how it ended.
    "WORKFLOW_SUBMITTED",
    "WORKFLOW_SUCCEEDED",
    "WORKFLOW_FAILED",
    "WORKFLOW_CANCELLED",
    "WORKFLOW_EXPIRED",
)


def can_transition(src: TaskStatus, dst: TaskStatus) -> bool:
    """True when the contract allows ``src -> dst``."""
    return dst in TRANSITIONS[src]


# json.dumps with any non-default option builds a new JSONEncoder per call; one is enough.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def compact_json(value: Any) -> str:
    """The one JSON form dtq stores and measures (DESIGN 10): what ``json.dumps(value,
    separators=(",", ":"), ensure_ascii=False, allow_nan=False)`` returns."""
    return _COMPACT.encode(value)


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


class _Encoded(NamedTuple):
    """What validation computes once from a :class:`SubmitRequest`'s payload and metadata."""

    payload_json: str
    metadata_json: str
    payload_size: int  # UTF-8 bytes
    metadata_size: int


_NOT_ENCODED = _Encoded("{}", "{}", 2, 2)


class SubmitOptions(TypedDict, total=False):
    """Every option of a submission besides its task type and payload: the keyword arguments
    of ``Queue.submit`` and ``Queue.submit_many``, the other fields of the HTTP body
    (:class:`SubmitRequest`) and the flags of ``dtq submit``. Defaults and rules are
    :class:`SubmitRequest`'s; a test keeps the model and the CLI's flags in step with this."""

    queue: str
    priority: int
    delay_seconds: float
    schedule_at: datetime | str | None
    ttl: timedelta | None  # the SDK's ttl_seconds as a timedelta (not a field of the body)
    ttl_seconds: float | None
    expires_at: datetime | str | None
    idempotency_key: str | None
    max_attempts: int
    timeout_ms: int | None
    metadata: Mapping[str, Any] | None


class SubmitItem(SubmitOptions, total=False):
    """One item of ``Queue.submit_many``: a task type, its payload and any option."""

    task_type: Required[str]
    payload: Mapping[str, Any] | None


SUBMIT_OPTIONS: frozenset[str] = frozenset(SubmitOptions.__annotations__)


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
    delay_seconds: float = Field(default=0, ge=0, le=MAX_DELAY_S)
    schedule_at: datetime | None = None
    expires_at: datetime | None = None
    ttl_seconds: float | None = Field(default=None, ge=0, le=MAX_DELAY_S)
    metadata: dict[str, Any] = Field(default_factory=dict)

    # Set by the validator. One private attribute (pydantic initialises each one per instance),
    # read through __pydantic_private__: a plain read of a private attribute goes through
    # pydantic's __getattr__ (about 1 us, and a submit reads it several times).
    # A factory, not a default: pydantic deep-copies a private default for every instance.
    _encoded: _Encoded = PrivateAttr(default_factory=lambda: _NOT_ENCODED)

    @field_validator("task_type")
    @classmethod
    def _task_type(cls, value: str) -> str:
        if not TASK_TYPE_RE.fullmatch(value):  # fullmatch: "$" alone lets a final "\n" in
            raise ValueError("must be 1-128 characters: letters, digits, '_', '.', ':', '-'")
        return value

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str) -> str:
        try:
            return check_queue_name(value)
        except InvalidTaskError as exc:
            raise ValueError(exc.message) from None

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

    @field_validator("schedule_at", "expires_at", mode="before")
    @classmethod
    def _iso_text(cls, value: Any) -> Any:
        # pydantic's lax mode reads a number as a Unix time; the API takes ISO 8601 text only.
        if isinstance(value, int | float):
            raise ValueError("must be an ISO 8601 time with an offset, e.g. 2030-01-28T17:00:00Z")
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
            or not 0 <= meta_ttl <= MAX_DELAY_S
        ):
            raise ValueError(f"metadata.ttl_seconds must be a number from 0 to {MAX_DELAY_S}")
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
        private = self.__pydantic_private__
        assert private is not None  # set before "after" validators run
        try:
            payload_json = compact_json(self.payload)
            metadata_json = compact_json(self.metadata) if self.metadata else "{}"
            # Sizes are UTF-8 bytes: a lone surrogate (JSON "\ud800") cannot be stored or sent.
            private["_encoded"] = _Encoded(
                payload_json,
                metadata_json,
                len(payload_json.encode()),
                len(metadata_json.encode()),
            )
        except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
            raise ValueError(f"payload and metadata must be JSON: {exc}") from None
        return self

    @classmethod
    def build(
        cls,
        settings: Settings,
        known_types: Collection[str] | None = None,
        payload_models: Mapping[str, type[BaseModel]] | None = None,
        /,
        **fields: Any,
    ) -> SubmitRequest:
        """Validate ``fields`` completely. ``known_types=None`` skips the registry check;
        ``payload_models`` are the models of the handlers that declare one."""
        try:
            req = cls(**fields)
        except ValidationError as exc:
            raise InvalidTaskError(_describe(exc), errors=_error_list(exc)) from None
        req.check_limits(settings, known_types, payload_models)
        return req

    def check_limits(
        self,
        settings: Settings,
        known_types: Collection[str] | None,
        payload_models: Mapping[str, type[BaseModel]] | None = None,
    ) -> None:
        if known_types is not None and self.task_type not in known_types:
            raise UnknownTaskTypeError(
                f"task_type {self.task_type!r} is not registered", task_type=self.task_type
            )
        size = self.payload_size
        if size > settings.max_payload_bytes:
            raise PayloadTooLargeError(
                f"payload is {size} bytes, the limit is {settings.max_payload_bytes}",
                size=size,
                limit=settings.max_payload_bytes,
            )
        meta_size = self._json().metadata_size
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
        model = payload_models.get(self.task_type) if payload_models else None
        if model is not None:
            validate_payload(model, self.payload, self.task_type)

    def _json(self) -> _Encoded:
        encoded: _Encoded = self.__pydantic_private__["_encoded"]  # type: ignore[index]
        return encoded

    @property
    def payload_json(self) -> str:
        """The payload's compact JSON (DESIGN 10), as stored and sent."""
        return self._json().payload_json

    @property
    def payload_size(self) -> int:
        """UTF-8 bytes of :attr:`payload_json`: what ``DTQ_MAX_PAYLOAD_BYTES`` limits."""
        return self._json().payload_size

    @property
    def metadata_json(self) -> str:
        return self._json().metadata_json

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


def validate_payload(model: type[_ModelT], payload: Mapping[str, Any], task_type: str) -> _ModelT:
    """The handler's ``payload_model`` accepts the payload (as the worker validates it
    before running the handler), or INVALID_TASK naming each refused field."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        errors = [
            {
                "field": ".".join(("payload", *(str(p) for p in e.get("loc", ())))),
                "message": str(e.get("msg", "invalid")),
            }
            for e in exc.errors()
        ]
        first = errors[0]
        raise InvalidTaskError(
            f"{first['field']}: {first['message']}", task_type=task_type, errors=errors
        ) from None


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


PROGRESS_DATA_MAX_BYTES = 4096
"""The most UTF-8 bytes of the compact JSON of one ``ctx.progress(..., data=...)``."""


def check_progress(fraction: object, data: object) -> tuple[float | None, str]:
    """The arguments of ``ctx.progress(fraction, data)`` as stored: the fraction (None or a
    number in [0, 1]) and the compact JSON of ``data`` (at most
    :data:`PROGRESS_DATA_MAX_BYTES`); else ValueError saying what is wrong."""
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(
                f"progress fraction must be None or a number from 0 to 1, not {fraction!r}"
            )
        if not 0 <= fraction <= 1:  # NaN fails both comparisons
            raise ValueError(f"progress fraction must be from 0 to 1, not {fraction!r}")
        fraction = float(fraction)
    try:
        data_json = compact_json(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"progress data is not JSON-serialisable: {exc}") from None
    size = len(data_json.encode())
    if size > PROGRESS_DATA_MAX_BYTES:
        raise ValueError(
            f"progress data is {size} bytes of JSON, more than {PROGRESS_DATA_MAX_BYTES}"
        )
    return fraction, data_json


class Progress(BaseModel):
    """The latest ``ctx.progress()`` of a task's current attempt (``updated_at``: when the
    worker wrote it, Redis clock; docs/handlers.md, "Progress")."""

    fraction: float | None = None
    data: Any = None
    updated_at: datetime

    @classmethod
    def from_field(cls, raw: str | None, attempt: int) -> Progress | None:
        """The hash's ``progress`` field, or None when there is none or it was written by an
        earlier attempt (a new attempt starts without progress)."""
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("attempt") != attempt:
                return None
            return cls(
                fraction=doc.get("fraction"), data=doc.get("data"), updated_at=doc["updated_at"]
            )
        except (ValueError, KeyError, ValidationError):  # a foreign write: not shown
            return None


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
    # The handler returned a result that was stored and has expired since
    # (DTQ_RESULT_RETENTION_S shorter than DTQ_TASK_RETENTION_S): ``result`` is None for that.
    result_expired: bool = False
    duplicate: bool = False
    progress: Progress | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    def is_expired_at(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @classmethod
    def from_hash(cls, h: Mapping[str, str], result: str | None = None) -> Task:
        """The task from its hash (the payload its ``payload`` field) and its result key."""

        def opt(name: str) -> str | None:
            v = h.get(name)
            return v if v else None

        def opt_int(name: str) -> int | None:
            v = opt(name)
            return None if v is None else int(v)

        retryable = opt("retryable")
        attempt = int(h.get("attempt") or 0)
        return cls(
            task_id=h["task_id"],
            idempotency_key=opt("idempotency_key"),
            task_type=h["task_type"],
            payload=json.loads(h.get("payload") or "{}"),
            created_at=h["created_at"],
            available_at=h.get("available_at") or h["created_at"],
            updated_at=opt("updated_at"),
            attempt=attempt,
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
            result_expired=not result and h.get("result_stored") == "1",
            progress=Progress.from_field(h.get("progress"), attempt),
        )

    def public_dict(self) -> dict[str, Any]:
        """The JSON form the API and the CLI's --json show."""
        return self.model_dump(mode="json")


def ttl_delta_seconds(ttl: timedelta | float | None) -> float | None:
    """The SDK's ``ttl=timedelta`` as seconds."""
    if ttl is None:
        return None
    return ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)
