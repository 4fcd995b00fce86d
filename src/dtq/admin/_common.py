"""What every admin operation shares: the audit identity, limits, small parsing helpers."""

from __future__ import annotations

import json
from typing import Any, cast

from dtq.calls import Audit
from dtq.models import check_queue_name as check_queue

__all__ = [
    "CHUNK",
    "LIST_CAP",
    "PREVIOUS_ATTEMPTS_CAP",
    "SCAN_CHUNK",
    "SWEEP_BATCH",
    "SWEEP_PER_CALL",
    "Audit",
    "StreamRows",
    "check_queue",
    "load_metadata",
    "stream_rows",
]

SWEEP_BATCH = 100  # tasks per expiry sweep batch
SWEEP_PER_CALL = 25  # tasks per expire.lua call of a sweep batch
CHUNK = 100  # tasks per script call of a purge, so no script runs long
LIST_CAP = 10_000  # most entries a list view returns (the DLQ and audit streams hold ~10,000)
SCAN_CHUNK = 1_000  # stream entries or zset members read per round trip while scanning
PREVIOUS_ATTEMPTS_CAP = 10  # earlier lives kept in metadata.previous_attempts
CAS_TRIES = 5  # reads + compare-and-set script calls before giving up on a changing task

StreamRows = list[tuple[str, dict[str, str]]]
"""XRANGE/XREVRANGE reply of a decode_responses client."""


def load_metadata(raw: str | None) -> dict[str, Any]:
    """A task's metadata field as a dict (it is always a JSON object when dtq wrote it)."""
    value = json.loads(raw) if raw else {}
    return value if isinstance(value, dict) else {"value": value}


def stream_rows(reply: Any) -> StreamRows:
    return cast(StreamRows, reply or [])
