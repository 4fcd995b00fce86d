"""Periodic schedules as data (docs/schedules.md): the definition a user gives, the schedule
as it is stored and read back, and what the firer sends for one firing.

Pure: no I/O, no clock (every "now" is a parameter, the Redis server's). The tick arithmetic
(cron with a time zone, intervals, catch-up planning) is :mod:`dtq.ticks`'; the scripts that
change a schedule are ``lua/schedule_put.lua``, ``lua/schedule_set.lua`` and ``lua/fire.lua``.

A schedule's hash (:func:`dtq.keys.schedule`) holds its ``definition`` (the JSON of a
:class:`ScheduleDef`, every field given or defaulted), its ``spec_key`` (the part of the
definition that decides the ticks: a change of it restarts the cursor from now), and its
state: ``cursor`` (the earliest tick not decided yet, epoch ms; "" once the schedule has
ended), ``paused`` and ``paused_reason``, ``buffered_ms`` (a tick the buffer_one overlap
policy holds back), ``last_task_id``, ``last_tick_ms``, ``last_fired_at``, ``last_error``,
the counters ``fired``, ``skipped_overlap`` and ``missed``, ``source`` (``api`` or ``code``),
``created_at``, ``updated_at`` and ``rev``, which every change moves: a firing planned from a
rev that is not the hash's any more does nothing.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dtq import ticks
from dtq.config import Settings
from dtq.errors import InvalidTaskError, ScheduleSpecError
from dtq.models import (
    MAX_DELAY_S,
    QUEUE_RE,
    SubmitRequest,
    compact_json,
    format_ts,
    parse_ts,
)

__all__ = [
    "BUFFER_POLL_MS",
    "CATCHUP_CAP",
    "HISTORY_CAP",
    "MAX_FIRE",
    "RESERVED_METADATA",
    "Catchup",
    "Overlap",
    "Schedule",
    "ScheduleDef",
    "check_schedule_name",
    "firing_of",
    "idempotency_key",
    "parse_schedule",
    "template_request",
]

Overlap = Literal["skip", "allow", "buffer_one"]
Catchup = Literal["skip", "latest", "all"]

HISTORY_CAP = 100  # decisions kept per schedule, newest first
MAX_FIRE = 32  # ticks one fire.lua call decides at most (the plan goes on in the next call)
CATCHUP_CAP = 100  # missed ticks the "all" policy fires at most after one downtime
BUFFER_POLL_MS = 1_000  # how often a held-back (buffer_one) firing looks at its previous task
MAX_WINDOW_S = 7 * 86_400
MAX_GRACE_S = 3_600
RESERVED_METADATA = ("schedule", "scheduled_for", "trigger")  # set by dtq on each firing


def check_schedule_name(name: object) -> str:
    """``name`` when it is a schedule name (the queue-name rules), else InvalidTaskError."""
    if isinstance(name, str) and QUEUE_RE.fullmatch(name):
        return name
    raise InvalidTaskError(
        f"{name!r} is not a valid schedule name: 1 to 64 of a-z, 0-9, '_' and '-', "
        "starting with a letter or digit",
        field="name",
    )


class ScheduleDef(BaseModel):
    """A schedule's definition: when (``cron`` with ``tz``, or ``every`` with an optional
    ``anchor``; optional ``start_at`` / ``end_at``), what (the task template: the fields of a
    submit but the idempotency key and the delay, and ``ttl_seconds`` counted from each tick),
    and the policies. The body of ``PUT /api/v1/schedules/{name}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cron: str | None = None
    tz: str = "UTC"
    every: int | str | None = None  # seconds, or "90s", "5m", "1h30m", "2d"
    anchor: datetime | None = None
    start_at: datetime | None = None
    end_at: datetime | None = None
    task_type: str
    payload: dict[str, Any] = Field(default_factory=dict)
    queue: str = "default"
    priority: int = Field(default=5, ge=0, le=9)
    max_attempts: int = Field(default=5, ge=1)
    timeout_ms: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    ttl_seconds: float | None = Field(default=None, gt=0, le=MAX_DELAY_S)
    overlap: Overlap = "skip"
    catchup: Catchup = "latest"
    catchup_window_s: int = Field(default=3_600, ge=1, le=MAX_WINDOW_S)
    # At least 3 s: a worker other than the leader fires a tick once it is 2 s late
    # (dtq.worker.firer.TAKEOVER_MS), and such a tick must still be late, not missed.
    grace_s: int = Field(default=10, ge=3, le=MAX_GRACE_S)
    paused: bool | None = None  # on create: start paused; on update: None keeps the state

    @field_validator("anchor", "start_at", "end_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        if value.utcoffset() is None:
            raise ValueError("must be timezone-aware (an ISO 8601 time with an offset, e.g. Z)")
        try:  # 9999-12-31T23:59:59-14:00 is in year 10000 in UTC, which no datetime holds
            value.astimezone(UTC)
        except (OverflowError, ValueError):
            raise ValueError("is out of range once in UTC (years 1 to 9999)") from None
        return value

    @field_validator("anchor", "start_at", "end_at", mode="before")
    @classmethod
    def _iso_text(cls, value: Any) -> Any:
        if isinstance(value, int | float):
            raise ValueError("must be an ISO 8601 time with an offset, e.g. 2030-01-28T17:00:00Z")
        return value

    @field_validator(
        "priority", "max_attempts", "timeout_ms", "ttl_seconds", "catchup_window_s", "grace_s",
        "every", mode="before",
    )  # fmt: skip
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        return value

    @classmethod
    def parse(cls, fields: Mapping[str, Any]) -> ScheduleDef:
        """Validate ``fields`` (the spec and its rules: :meth:`checked`); dtq's errors only."""
        try:
            d = cls.model_validate(dict(fields))
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err.get("loc", ())) or "schedule"
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            raise InvalidTaskError(f"{field}: {msg}", field=field) from None
        return d.checked()

    def checked(self) -> ScheduleDef:
        """This definition with ``every`` as whole seconds and the cron expression normalised,
        or ScheduleSpecError naming the field that is wrong."""
        if (self.cron is None) == (self.every is None):
            raise ScheduleSpecError("give exactly one of cron and every", field="cron")
        update: dict[str, Any] = {}
        if self.cron is not None:
            if self.anchor is not None:
                raise ScheduleSpecError("anchor goes with every, not with cron", field="anchor")
            cron = ticks.parse_cron(self.cron, self.tz)
            update["cron"], update["tz"] = cron.expr, cron.tz
        else:
            if self.tz != "UTC":
                raise ScheduleSpecError(
                    "tz goes with cron: an interval counts seconds, whatever the zone", field="tz"
                )
            update["every"] = ticks.parse_every(self.every)  # type: ignore[arg-type]
        if self.start_at and self.end_at and self.end_at <= self.start_at:
            raise ScheduleSpecError("end_at must be after start_at", field="end_at")
        for key in RESERVED_METADATA:
            if key in self.metadata:
                raise InvalidTaskError(
                    f"metadata.{key} is set by dtq on each firing", field=f"metadata.{key}"
                )
        return self.model_copy(update=update)

    # -- what decides the ticks -----------------------------------------------------------------

    def spec(self) -> ticks.Spec:
        if self.cron is not None:
            return ticks.Cron(self.cron, self.tz)
        assert isinstance(self.every, int)  # checked() made it whole seconds
        anchor = 0 if self.anchor is None else _ms(self.anchor)
        return ticks.Every(self.every, anchor)

    @property
    def start_ms(self) -> int | None:
        return None if self.start_at is None else _ms(self.start_at)

    @property
    def end_ms(self) -> int | None:
        return None if self.end_at is None else _ms(self.end_at)

    def spec_key(self) -> str:
        """The fields that decide the ticks, as one string: a change of any restarts the
        cursor from now; a change of anything else keeps it."""
        return compact_json(
            [self.cron, self.tz, self.every, _iso(self.anchor), _iso(self.start_at),
             _iso(self.end_at)]
        )  # fmt: skip

    def stored(self) -> str:
        """The definition as its hash keeps it (``paused`` is state, kept apart)."""
        return self.model_dump_json(exclude={"paused"})

    def first_cursor(self, now_ms: int) -> int | None:
        """The first tick of a new or respecified schedule: the first at or after ``now_ms``
        (and ``start_at``); None when there is none before ``end_at``."""
        after = now_ms - 1
        if self.start_ms is not None:
            after = max(after, self.start_ms - 1)
        return ticks.next_after(self.spec(), after, end_ms=self.end_ms)

    def template(self) -> dict[str, Any]:
        """The submit fields of a firing, but its idempotency key, deadline and metadata."""
        return {
            "task_type": self.task_type,
            "payload": self.payload,
            "queue": self.queue,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "timeout_ms": self.timeout_ms,
        }


def _ms(dt: datetime) -> int:
    return round(dt.timestamp() * 1000)


def _iso(dt: datetime | None) -> str | None:
    return None if dt is None else format_ts(_ms(dt))


def idempotency_key(name: str, tick_ms: int, manual: str | None = None) -> str:
    """The idempotency key of a firing: ``schedule:<name>:<tick ms>`` for a tick,
    ``schedule:<name>:manual:<key>`` for a manual one."""
    if manual is not None:
        return f"schedule:{name}:manual:{manual}"
    return f"schedule:{name}:{tick_ms}"


def firing_of(key: str | None) -> tuple[str, int | None] | None:
    """(schedule name, tick ms) of a task a schedule fired, read from its idempotency key
    (tick None for a manual firing); None for any other key. No read of the task's metadata:
    the worker's start has the key at hand."""
    if not key or not key.startswith("schedule:"):
        return None
    parts = key.split(":", 3)
    if len(parts) < 3 or not QUEUE_RE.fullmatch(parts[1]):
        return None
    if parts[2] == "manual" and len(parts) == 4:
        return parts[1], None
    if len(parts) == 3 and parts[2].isdigit():
        return parts[1], int(parts[2])
    return None


def template_request(
    d: ScheduleDef,
    name: str,
    tick_ms: int,
    settings: Settings,
    known_types: Collection[str] | None = None,
    payload_models: Mapping[str, type[BaseModel]] | None = None,
    *,
    manual: str | None = None,
) -> SubmitRequest:
    """The submit request of the firing of ``d`` for ``tick_ms``: the template, the firing's
    idempotency key, ``metadata.schedule`` and ``metadata.scheduled_for`` (the tick, ISO 8601
    UTC; ``metadata.trigger = "manual"`` for a manual firing) and, with ``ttl_seconds``, the
    deadline ``tick + ttl_seconds`` (a tick that cannot start in time expires)."""
    meta = dict(d.metadata)
    meta["schedule"] = name
    meta["scheduled_for"] = format_ts(tick_ms)
    if manual is not None:
        meta["trigger"] = "manual"
    fields = d.template()
    fields["metadata"] = meta
    fields["idempotency_key"] = idempotency_key(name, tick_ms, manual)
    if d.ttl_seconds is not None:
        deadline = tick_ms + round(d.ttl_seconds * 1000)
        fields["expires_at"] = datetime.fromtimestamp(deadline / 1000, tz=UTC)
    return SubmitRequest.build(
        settings, known_types, payload_models, **{k: v for k, v in fields.items() if v is not None}
    )


class Schedule(BaseModel):
    """A schedule as ``get`` and ``list`` give it (and ``GET /api/v1/schedules/{name}``).

    ``state``: ``active``, ``paused`` or ``ended`` (no tick left before ``end_at``);
    ``next_fire_at``: the cursor (the earliest tick not decided yet; in the past while a
    firing is late or the schedule is paused); ``history``: the latest decisions, newest
    first (only ``get`` reads it)."""

    name: str
    state: Literal["active", "paused", "ended"]
    paused_reason: str | None = None
    origin: Literal["api", "code"] = "api"  # made over the SDK/HTTP/CLI, or declared in code
    definition: ScheduleDef
    next_fire_at: datetime | None = None
    last_tick_at: datetime | None = None
    last_fired_at: datetime | None = None
    last_task_id: str | None = None
    buffered_for: datetime | None = None
    last_error: str | None = None
    fired: int = 0
    skipped_overlap: int = 0
    missed: int = 0
    created_at: datetime | None = None
    updated_at: datetime | None = None
    rev: int = 0
    history: list[dict[str, Any]] = Field(default_factory=list)


def _dt(ms: str | None) -> datetime | None:
    return None if not ms else datetime.fromtimestamp(int(ms) / 1000, tz=UTC)


def parse_schedule(h: Mapping[str, str], history: list[str] | None = None) -> Schedule:
    """A schedule hash (HGETALL) and its history list -> :class:`Schedule`."""
    d = ScheduleDef.model_validate_json(h["definition"])
    paused = h.get("paused") == "1"
    cursor = h.get("cursor") or ""
    state: Literal["active", "paused", "ended"] = (
        "paused" if paused else "ended" if not cursor and not h.get("buffered_ms") else "active"
    )
    return Schedule(
        name=h["name"],
        state=state,
        paused_reason=h.get("paused_reason") or None,
        origin="code" if h.get("source") == "code" else "api",
        definition=d.model_copy(update={"paused": paused}),
        next_fire_at=_dt(cursor),
        last_tick_at=_dt(h.get("last_tick_ms")),
        last_fired_at=parse_ts(h.get("last_fired_at")),
        last_task_id=h.get("last_task_id") or None,
        buffered_for=_dt(h.get("buffered_ms")),
        last_error=h.get("last_error") or None,
        fired=int(h.get("fired") or 0),
        skipped_overlap=int(h.get("skipped_overlap") or 0),
        missed=int(h.get("missed") or 0),
        created_at=parse_ts(h.get("created_at")),
        updated_at=parse_ts(h.get("updated_at")),
        rev=int(h.get("rev") or 0),
        history=[json.loads(e) for e in history or ()],
    )
