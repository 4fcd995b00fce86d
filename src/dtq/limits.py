"""Rate and concurrency limits (deliberate extension: docs/limits.md): the definition of one
limit, and the pure math the worker needs to send it to ``start.lua``.

A limit belongs to one queue (its state lives in that queue's slot in the cluster layout, so
the start script that admits a task also takes its place), optionally narrowed to one task
type, optionally split by a key taken from the payload (one limit per key value). It has a
smooth rate (GCRA: one task every ``period / count`` on average, ``burst`` of them at once at
most), a concurrency (RUNNING tasks at most), or both.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dtq.errors import InvalidTaskError
from dtq.models import QUEUE_RE, TASK_TYPE_RE

__all__ = [
    "KEY_VALUE_MAX",
    "LIMIT_NAME_RE",
    "NO_KEY",
    "LimitDef",
    "LimitSpecError",
    "Rate",
    "check_limit_name",
    "key_value",
    "parse_rate",
]

LIMIT_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
KEY_PATH_RE = re.compile(r"^payload(\.[A-Za-z0-9_-]{1,64}){1,8}$")
KEY_VALUE_MAX = 128  # a longer key value is cut and suffixed with its hash in the key's name
NO_KEY = "_none"  # the bucket of the tasks whose payload has no value at the key's path
_RATE_RE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)?\s*"
    r"(ms|s|sec|second|seconds|m|min|minute|minutes|h|hour|hours)\s*$"
)
_UNIT_MS = {"ms": 1, "s": 1000, "sec": 1000, "second": 1000, "seconds": 1000, "m": 60_000,
            "min": 60_000, "minute": 60_000, "minutes": 60_000, "h": 3_600_000,
            "hour": 3_600_000, "hours": 3_600_000}  # fmt: skip


class LimitSpecError(InvalidTaskError):
    """A limit definition dtq cannot use (HTTP 400)."""

    code = "INVALID_LIMIT"


def check_limit_name(name: object) -> str:
    if not isinstance(name, str) or not LIMIT_NAME_RE.fullmatch(name):
        raise LimitSpecError(
            f"limit name {name!r} is invalid: 1-128 characters, letters, digits, '_', '.', ':', '-'"
        )
    return name


class Rate(BaseModel):
    """``count`` tasks per ``period_ms``: one every ``interval_ms`` on average."""

    model_config = ConfigDict(frozen=True)

    count: float
    period_ms: float

    @property
    def interval_ms(self) -> float:
        return self.period_ms / self.count

    def per_second(self) -> float:
        return self.count * 1000 / self.period_ms


def parse_rate(text: object) -> Rate:
    """``"100/s"``, ``"5/m"``, ``"1000/h"``, ``"10/30s"``, ``"1/500ms"``."""
    m = _RATE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise LimitSpecError(
            f"rate {text!r} is not COUNT/PERIOD, e.g. '100/s', '5/m', '1000/h' or '10/30s'"
        )
    count = float(m.group(1))
    period_ms = float(m.group(2) or 1) * _UNIT_MS[m.group(3)]
    if count <= 0 or period_ms <= 0 or not math.isfinite(period_ms / count):
        raise LimitSpecError(f"rate {text!r}: the count and the period must be more than 0")
    if period_ms / count < 0.01:
        raise LimitSpecError(f"rate {text!r} is more than 100,000 tasks a second")
    return Rate(count=count, period_ms=period_ms)


class LimitDef(BaseModel):
    """One limit, as stored (JSON, in its queue's limits hash) and as a PUT takes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue: str = "default"
    task_type: str | None = None
    key: str | None = None
    rate: str | None = None
    burst: int | None = Field(default=None, ge=1, le=1_000_000)
    concurrency: int | None = Field(default=None, ge=1, le=1_000_000)
    source: Literal["api", "code"] = "api"

    @field_validator("queue")
    @classmethod
    def _queue(cls, v: str) -> str:
        if not QUEUE_RE.fullmatch(v):
            raise ValueError(f"queue {v!r} is not a valid queue name")
        return v

    @field_validator("task_type")
    @classmethod
    def _task_type(cls, v: str | None) -> str | None:
        if v is not None and not TASK_TYPE_RE.fullmatch(v):
            raise ValueError(f"task_type {v!r} is not a valid task type")
        return v

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not KEY_PATH_RE.fullmatch(v):
            raise ValueError(
                f"key {v!r} is not a payload path such as 'payload.tenant_id' "
                "(1 to 8 names of letters, digits, '_' or '-')"
            )
        return v

    @field_validator("rate")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_rate(v)
            except LimitSpecError as exc:
                raise ValueError(exc.message) from None
        return v

    @model_validator(mode="after")
    def _something(self) -> LimitDef:
        if self.rate is None and self.concurrency is None:
            raise ValueError("a limit needs a rate, a concurrency, or both")
        if self.burst is not None and self.rate is None:
            raise ValueError("burst needs a rate")
        return self

    @classmethod
    def parse(cls, fields: Mapping[str, Any]) -> LimitDef:
        """The definition from a PUT body or the SDK's fields; LimitSpecError when invalid."""
        try:
            return cls.model_validate(dict(fields))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = str(first["msg"]).removeprefix("Value error, ")
            raise LimitSpecError(f"invalid limit: {where + ': ' if where else ''}{msg}") from None

    @classmethod
    def stored(cls, text: str) -> LimitDef | None:
        """A definition as a limits hash holds it; None when it is not a valid one (written
        by hand, or by a newer dtq): such a limit is applied nowhere and listed nowhere, and a
        put replaces it."""
        try:
            return cls.parse(json.loads(text))
        except (ValueError, LimitSpecError):
            return None

    @property
    def parsed_rate(self) -> Rate | None:
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def interval_ms(self) -> float:
        """GCRA's emission interval (0: no rate)."""
        rate = self.parsed_rate
        return 0.0 if rate is None else rate.interval_ms

    @property
    def tolerance_ms(self) -> float:
        """GCRA's tolerance: how far ahead of now a key's theoretical arrival time may run,
        ``(burst - 1) * interval`` (a burst of 1: a smooth rate, no task early)."""
        return ((self.burst or 1) - 1) * self.interval_ms

    def applies_to(self, queue: str, task_type: str) -> bool:
        return queue == self.queue and (self.task_type is None or self.task_type == task_type)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(exclude_none=True), separators=(",", ":"))


def key_value(limit: LimitDef, payload: Mapping[str, Any]) -> str:
    """The key value of a task under ``limit`` ("" for a limit without a key): the payload's
    value at the key's path, as text (a string as it is, another JSON value as compact JSON);
    :data:`NO_KEY` when the payload has none there. A value longer than
    :data:`KEY_VALUE_MAX` is cut and suffixed with its hash, so a key's name stays bounded."""
    if limit.key is None:
        return ""
    value: Any = payload
    for part in limit.key.split(".")[1:]:
        if not isinstance(value, Mapping) or part not in value:
            return NO_KEY
        value = value[part]
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if not text:
        return NO_KEY
    if len(text) > KEY_VALUE_MAX:
        digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]
        text = text[: KEY_VALUE_MAX - 17] + "~" + digest
    return text
