"""Lifecycle events (contract section 8): JSON published on the ``dtq:events`` channel.

Task events are published by the Lua scripts, atomically with the state change they describe;
this module builds the worker and configuration events that Python publishes, and names the
terminal ones. Subscribers get the published JSON text as it is: the WebSocket hub forwards it
unchanged and reads only ``type``, ``queue`` and ``task_id`` to filter.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from dtq.models import EVENT_TYPES

__all__ = ["TERMINAL_EVENTS", "make_event"]

TERMINAL_EVENTS = frozenset(
    {
        "TASK_SUCCEEDED",
        "TASK_FAILED",
        "TASK_DEAD_LETTERED",
        "TASK_CANCELLED",
        "TASK_EXPIRED",
    }
)


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
