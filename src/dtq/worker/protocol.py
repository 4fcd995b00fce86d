"""The worker's side of the delivery protocol (DESIGN 3, 4): stream entries, and the KEYS and
ARGV of the read, start, finish and touch scripts, and their replies. No I/O here; the worker
sends what this builds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dtq import keys
from dtq.config import Settings
from dtq.scripts import Call
from dtq.store import new_id

__all__ = [
    "Entry",
    "Outcome",
    "ReadPlan",
    "ReadReply",
    "StartReply",
    "finish_call",
    "parse_read",
    "start_call",
    "touch_args",
]

log = logging.getLogger(__name__)

OutcomeKind = Literal["success", "error", "reschedule", "cancelled"]


@dataclass(frozen=True)
class Entry:
    """One delivered stream entry (contract section 2's fields)."""

    stream: str
    entry_id: str
    task_id: str
    queue: str
    task_type: str
    payload: str
    idempotency_key: str
    timeout_ms: int

    @classmethod
    def parse(cls, stream: str, entry_id: str, fields: Mapping[str, str] | None) -> Entry | None:
        """The entry, or None when its fields are missing or malformed (a foreign write)."""
        if not fields or not fields.get("task_id"):
            return None
        queue = fields.get("queue") or keys.stream_queue(stream)[0]
        try:
            timeout_ms = int(fields.get("timeout_ms") or 0)
        except ValueError:
            timeout_ms = 0
        return cls(
            stream=stream,
            entry_id=entry_id,
            task_id=fields["task_id"],
            queue=queue,
            task_type=fields.get("task_type", ""),
            payload=fields.get("payload", ""),
            idempotency_key=fields.get("idempotency_key", ""),
            timeout_ms=timeout_ms,
        )


def parse_read(
    reply: Sequence[Any] | None,
) -> tuple[list[Entry], list[tuple[str, str]]]:
    """XREADGROUP's reply -> (entries, (stream, id) of entries whose fields are unusable)."""
    entries: list[Entry] = []
    bad: list[tuple[str, str]] = []
    for stream, items in reply or []:
        for entry_id, fields in items:
            entry = Entry.parse(stream, entry_id, fields)
            if entry is None:
                bad.append((stream, entry_id))
            else:
                entries.append(entry)
    return entries, bad


def _flat_fields(flat: Sequence[str] | None) -> dict[str, str]:
    """An entry's fields as a script replies them, ``[field, value, ...]``, as a mapping."""
    it = iter(flat or ())
    return dict(zip(it, it, strict=False))


@dataclass(frozen=True)
class ReadReply:
    """read.lua's answer: what was read, and what the poll loop does next when nothing was."""

    entries: list[Entry]
    bad: list[tuple[str, str]]  # (stream, id) of entries without usable task fields
    nogroup: list[str]  # streams without the consumer group
    paused: frozenset[str]  # queues whose streams were not read
    since: dict[str, str]  # nothing read: stream -> the id to XREAD BLOCK from


class ReadPlan:
    """The KEYS and ARGV of read.lua for one worker's queues, built once: the paused flags,
    then every stream p9 first across the queues (strict priority, contract section 6). The
    script relies on that order: stream k (from 1) is queue ``(k - 1) % m + 1``'s, m queues."""

    def __init__(self, queues: Sequence[str], worker_id: str) -> None:
        self.queues = list(queues)
        self.streams = [keys.stream(q, p) for p in keys.PRIORITIES for q in self.queues]
        self.keys = [*(keys.queue_paused(q) for q in self.queues), *self.streams]
        self._head: list[str] = [keys.CONSUMER_GROUP, worker_id]
        self._m = str(len(self.queues))

    def call(self, count: int) -> Call:
        """Read at most ``count`` entries (the slots the caller reserved)."""
        return ("read", self.keys, [*self._head, count, self._m])

    def parse(self, reply: Sequence[Any]) -> ReadReply:
        got, nogroup, paused, since = reply
        # {k, items, ...} with flat fields, reshaped as redis-py gives XREADGROUP for parse_read.
        entries, bad = parse_read(
            [
                (self.streams[int(got[i]) - 1], [(eid, _flat_fields(f)) for eid, f in got[i + 1]])
                for i in range(0, len(got), 2)
            ]
        )
        return ReadReply(
            entries,
            bad,
            [self.streams[int(k) - 1] for k in nogroup],
            frozenset(self.queues[int(q) - 1] for q in paused),
            {self.streams[int(since[i]) - 1]: str(since[i + 1]) for i in range(0, len(since), 2)},
        )


@dataclass(frozen=True)
class StartReply:
    """start.lua's answer. ``kind`` is run, missing, terminal, cancelled, duplicate, expired,
    dead or fenced (the entry is not pending for this worker); the numbers are set for
    ``run``."""

    kind: str
    detail: str = ""
    attempt: int = 0
    max_attempts: int = 0
    timeout_ms: int = 0
    expires_at_ms: int | None = None
    created_ms: int | None = None
    started_ms: int = 0

    @classmethod
    def parse(cls, reply: Sequence[Any]) -> StartReply:
        kind = str(reply[0])
        if kind != "run":
            return cls(kind, str(reply[1]) if len(reply) > 1 else "")
        _, attempt, max_attempts, timeout_ms, exp_ms, created_ms, started_ms = reply
        return cls(
            kind,
            attempt=int(attempt),
            max_attempts=int(max_attempts),
            timeout_ms=int(timeout_ms),
            expires_at_ms=int(exp_ms) if exp_ms not in ("", None) else None,
            created_ms=int(created_ms) if created_ms not in ("", None) else None,
            started_ms=int(started_ms),
        )


def start_call(entry: Entry, worker_id: str, settings: Settings) -> Call:
    s = settings
    return (
        "start",
        [
            keys.task(entry.task_id),
            keys.history(entry.task_id),
            entry.stream,
            keys.CANCELLED,
            keys.EXPIRY,
            keys.idempotency(entry.queue, entry.idempotency_key),
            keys.DEAD_LETTER,
            keys.payload(entry.task_id),
        ],
        [
            entry.task_id,
            entry.entry_id,
            worker_id,
            keys.CONSUMER_GROUP,
            s.task_retention_s,
            s.idem_ttl_s,
            keys.EVENTS,
            new_id(),
            "1" if s.dlq_enabled else "0",
            s.dlq_maxlen,
        ],
    )


@dataclass(frozen=True)
class Outcome:
    """How one execution ended, as finish.lua records it."""

    kind: OutcomeKind
    duration_ms: int = 0
    result_json: str = ""
    result_too_large: bool = False
    error_class: str = ""
    error_message: str = ""
    retryable: bool = False
    delay_ms: int = 0
    extend_ms: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


def finish_call(
    entry: Entry, attempt: int, outcome: Outcome, worker_id: str, settings: Settings
) -> Call:
    s = settings
    return (
        "finish",
        [
            keys.task(entry.task_id),
            keys.history(entry.task_id),
            entry.stream,
            keys.RETRY_SCHEDULE,
            keys.EXPIRY,
            keys.idempotency(entry.queue, entry.idempotency_key),
            keys.DEAD_LETTER,
            keys.result(entry.task_id),
            keys.CANCELLED,
            keys.payload(entry.task_id),
        ],
        [
            entry.task_id,
            entry.entry_id,
            worker_id,
            keys.CONSUMER_GROUP,
            attempt,
            outcome.kind,
            outcome.result_json,
            "1" if outcome.result_too_large else "0",
            outcome.error_class,
            outcome.error_message,
            "1" if outcome.retryable else "0",
            outcome.delay_ms,
            "" if outcome.extend_ms is None else outcome.extend_ms,
            outcome.duration_ms,
            s.task_retention_s,
            s.result_retention_s,
            s.idem_ttl_s,
            keys.EVENTS,
            new_id(),
            "1" if s.dlq_enabled else "0",
            s.dlq_maxlen,
        ],
    )


def touch_args(worker_id: str, owned: Sequence[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of touch.lua for (stream, entry id) pairs."""
    return (
        [stream for stream, _ in owned],
        [keys.CONSUMER_GROUP, worker_id, *(entry_id for _, entry_id in owned)],
    )
