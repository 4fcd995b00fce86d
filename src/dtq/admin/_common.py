"""What every admin operation shares: the audit identity, limits, small parsing helpers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

from dtq import keys
from dtq.calls import Audit
from dtq.models import check_queue_name as check_queue
from dtq.store import Store

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
    "newest_entries",
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


def _entry_order(row: tuple[str, dict[str, str]]) -> tuple[int, int]:
    ms, _, seq = row[0].partition("-")
    return int(ms), int(seq or 0)


async def newest_entries(
    store: Store, stream: Callable[[str], str], limit: int, also: str | None = None
) -> StreamRows:
    """The newest ``limit`` entries of the stream ``stream(scope)`` names (the dead-letter or
    the audit stream), newest first: one XREVRANGE in the flat layout; one per queue's stream
    (and ``also``'s, a queue that may not be listed) in the cluster layout, merged by entry id
    (the Redis time each was added at)."""
    rows: StreamRows = []
    scopes = await store.scopes()
    if keys.cluster_layout() and also is not None and also not in scopes:
        scopes.append(also)
    for scope in scopes:
        rows += stream_rows(await store.redis.xrevrange(stream(scope), "+", "-", count=limit))
    if len(scopes) > 1:
        rows.sort(key=_entry_order, reverse=True)
    return rows[:limit]
