"""Lifecycle events (contract section 8): JSON published on the ``dtq:events`` channel.

Task events are published by the Lua scripts, atomically with the state change they describe;
this module builds the worker and configuration events that Python publishes, and parses any
event for subscribers (WebSocket hub, CLI, tests).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from dtq.models import EVENT_TYPES

__all__ = ["TERMINAL_EVENTS", "Event", "make_event"]

TERMINAL_EVENTS = frozenset(
    {
        "TASK_SUCCEEDED",
        "TASK_FAILED",
        "TASK_DEAD_LETTERED",
        "TASK_CANCELLED",
        "TASK_EXPIRED",
    }
)


class Event(BaseModel):
    event_id: str
    ts: datetime
    type: str
    task_id: str | None = None
    queue: str | None = None
    task_type: str | None = None
    attempt: int | None = None
    worker_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def parse(cls, raw: str | bytes) -> Event:
        data = json.loads(raw)
        if not isinstance(data.get("metadata"), dict):  # Lua's cjson encodes {} as []
            data["metadata"] = {}
        return cls(**data)

    @property
    def is_terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS


def make_event(
    etype: str,
    *,
    task_id: str | None = None,
    queue: str | None = None,
    task_type: str | None = None,
    attempt: int | None = None,
    worker_id: str | None = None,
    metadata: dict[str, Any] | None = None,
    ts_ms: int | None = None,
) -> str:
    """The JSON of one event; ``ts_ms`` should come from the Redis clock (dtq.clock)."""
    if etype not in EVENT_TYPES:
        raise ValueError(f"unknown event type {etype!r}")
    ts = datetime.now(UTC) if ts_ms is None else datetime.fromtimestamp(ts_ms / 1000, tz=UTC)
    event: dict[str, Any] = {
        "event_id": uuid.uuid4().hex,
        "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "type": etype,
        "task_id": task_id,
        "queue": queue,
        "task_type": task_type,
        "attempt": attempt,
        "worker_id": worker_id,
    }
    if metadata:
        event["metadata"] = metadata
    return json.dumps(event, separators=(",", ":"))
