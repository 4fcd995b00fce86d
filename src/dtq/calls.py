"""The Python half of every Lua script: its function here, in the order of
:data:`dtq.scripts.SCRIPT_NAMES`. Each builds its script's KEYS (from :mod:`dtq.keys`) and ARGV
in the order of the script's header, sends it through :class:`~dtq.scripts.Scripts` and parses
the reply into a small frozen value; nothing else in dtq builds KEYS or ARGV or calls a script
(``tests/unit/test_calls_module.py`` checks it). Adding an argument to a script touches its
``.lua`` file and its function here, and nothing else.

The hot-path scripts take a batch and send it in one round trip: ``submit`` (up to
``SUBMIT_CHUNK`` tasks per call), ``start_many`` (a read batch), ``finish_many`` (the
finisher's batch of one event-loop tick); the scheduler's ``promote_many`` and
``expire_sweep`` likewise. The policy around a script (which tasks to send, what a refusal means
to a user) stays with its caller: :mod:`dtq.store`, :mod:`dtq.admin`, :mod:`dtq.worker`.

Every function that sends takes a :class:`Backend` (the Redis client, the loaded scripts and
the settings; a :class:`~dtq.store.Store` is one), except :func:`touch_blocking`, which runs on
the heartbeat's thread with its own synchronous client. Two scripts also have a builder:
:func:`finish_call` (the worker's finisher gathers the calls of one event-loop tick before
:func:`finish_many` sends them) and :func:`submit_calls`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import redis as redis_sync
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from dtq import keys
from dtq.config import Settings
from dtq.models import SubmitRequest
from dtq.scripts import Call, Scripts, WaitError

__all__ = [
    "FAIR_WINDOW",
    "RECENT_CAP",
    "SUBMIT_CHUNK",
    "Audit",
    "Backend",
    "CancelReply",
    "Claimed",
    "DlqReply",
    "Entry",
    "ExpireReply",
    "FairMoved",
    "FinishReply",
    "FireCandidate",
    "FireDecision",
    "FireReply",
    "Firing",
    "LostEntry",
    "Outcome",
    "ProgressReply",
    "PromoteReply",
    "PurgeCandidate",
    "QueuePurged",
    "ReadPlan",
    "ReadReply",
    "RemoveQueueReply",
    "StartReply",
    "SubmitReply",
    "Submitted",
    "Where",
    "adopt",
    "cancel",
    "claim_due",
    "dlq_discard",
    "dlq_purge",
    "dlq_requeue",
    "drop_consumers",
    "expire",
    "expire_sweep",
    "fair_move",
    "finish_call",
    "finish_many",
    "fire",
    "fire_call",
    "fire_calls",
    "lock",
    "new_id",
    "parse_read",
    "progress",
    "promote_many",
    "purge_queue",
    "read",
    "recover_many",
    "remove_queue",
    "schedule_put",
    "schedule_set",
    "set_paused",
    "start_many",
    "submit",
    "submit_calls",
    "touch",
    "touch_blocking",
]

SUBMIT_CHUNK = 32  # tasks per submit.lua call: ~0.4 ms of Redis, so no call runs long
RECENT_CAP = 10_000  # members kept in dtq:tasks:recent (submit.lua trims to it)

Where = tuple[str, int, str]
"""(queue, priority, idempotency_key) of a task: what decides its stream and record keys."""


class Backend(Protocol):
    """What a script call runs against (a :class:`~dtq.store.Store` is one)."""

    @property
    def redis(self) -> Redis: ...

    @property
    def scripts(self) -> Scripts: ...

    @property
    def settings(self) -> Settings: ...


def new_task_id(queue: str) -> str:
    """A new task id of ``queue``: :func:`new_id`, whose first digits are the queue's slot tag
    in the cluster layout (:func:`dtq.keys.task_id_prefix`)."""
    prefix = keys.task_id_prefix(queue)
    return prefix + new_id()[len(prefix) :] if prefix else new_id()


def new_id() -> str:
    """A random UUID4 as 32 hex digits (what ``uuid.uuid4().hex`` gives, in a third of the time:
    a submit makes two): task ids and event ids."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    return b.hex()


@dataclass(frozen=True)
class Audit:
    """Who asked for an operation: ``actor`` (e.g. ``api:<key id>``, ``cli:<user>@<host>``) and
    the request it came with. Given to an operation, it makes the operation's script append one
    entry to ``dtq:stream:audit`` atomically with the change."""

    actor: str
    request_id: str | None = None

    def __post_init__(self) -> None:
        if not self.actor:
            raise ValueError("Audit.actor must not be empty")


def _audit(audit: Audit | None) -> list[str]:
    """The two ARGV values (actor, request_id) every admin script takes; "" = no audit."""
    return ["", ""] if audit is None else [audit.actor, audit.request_id or ""]


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _int_or_none(value: Any) -> int | None:
    return None if value in ("", None) else int(value)


# -- submit.lua ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubmitReply:
    """submit.lua's answer for one task. ``kind`` "new": accepted, with its ``status``,
    ``entry_id`` ("" when scheduled), the Redis time ``now_ms``, ``due_ms`` and
    ``expires_at_ms``; "dup": the idempotency key's ``task_id`` (``status`` is the record's
    state); "err": refused, ``code`` (QUEUE_FULL, IDEMPOTENCY_IN_PROGRESS) and ``detail``."""

    kind: Literal["new", "dup", "err"]
    status: str = ""
    entry_id: str = ""
    now_ms: int = 0
    due_ms: int = 0
    expires_at_ms: int | None = None
    task_id: str = ""
    code: str = ""
    detail: str = ""


def _queue_block(queue: str) -> list[str]:
    """A queue's keys in a submit call: its ten streams, then its three fairness keys, built
    once per layout: a process that switches layouts (the tests, the benchmarks) must not get
    the other layout's names."""
    return _layout_block(queue, keys.cluster_layout())


@functools.lru_cache(maxsize=4096)
def _layout_block(queue: str, cluster: bool) -> list[str]:
    """:func:`_queue_block`, cached by queue and layout (``cluster`` is the cache's key)."""
    return [*keys.queue_streams(queue), *keys.fair_keys(queue)]


def submit_calls(
    reqs: Sequence[SubmitRequest], ids: Sequence[str], settings: Settings
) -> list[Call]:
    """The submit.lua calls of a batch: one per ``SUBMIT_CHUNK`` tasks, in order (in the
    cluster layout, per queue: :func:`submit_chunks`)."""
    return [
        _submit_call([reqs[i] for i in chunk], [ids[i] for i in chunk], settings)
        for chunk in submit_chunks(reqs)
    ]


def submit_chunks(reqs: Sequence[SubmitRequest]) -> list[list[int]]:
    """The indexes of ``reqs`` each submit.lua call takes: runs of ``SUBMIT_CHUNK`` in order;
    in the cluster layout, where one call touches one slot, each queue's tasks apart (still in
    their order, and still at most ``SUBMIT_CHUNK`` a call)."""
    if not keys.cluster_layout():
        return [
            list(range(i, min(i + SUBMIT_CHUNK, len(reqs))))
            for i in range(0, len(reqs), SUBMIT_CHUNK)
        ]
    by_queue: dict[str, list[int]] = {}
    for i, req in enumerate(reqs):
        by_queue.setdefault(req.queue, []).append(i)
    return [
        idx[j : j + SUBMIT_CHUNK]
        for idx in by_queue.values()
        for j in range(0, len(idx), SUBMIT_CHUNK)
    ]


def _submit_call(reqs: Sequence[SubmitRequest], ids: Sequence[str], s: Settings) -> Call:
    queues: dict[str, int] = {}
    task_keys: list[str] = []
    args: list[Any] = [
        s.max_queue_depth,
        s.task_retention_s,
        s.idem_ttl_s,
        keys.events(reqs[0].queue),
        RECENT_CAP,
        0,  # the number of queues, below
    ]
    default_timeout = s.task_timeout_ms
    for req, task_id in zip(reqs, ids, strict=True):
        queue = req.queue
        q = queues.get(queue)
        if q is None:
            q = queues[queue] = len(queues)
        idem = req.idempotency_key
        task_keys += (
            keys.task(task_id),
            keys.history(task_id),
            keys.idempotency(queue, idem),
        )
        ttl_ms = req.effective_ttl_ms()
        exp_ms = req.expires_at_ms()
        sched_ms = req.schedule_at_ms()
        args += (
            task_id,
            req.task_type,
            req.payload_json,
            queue,
            q,
            idem or "",
            req.max_attempts,
            req.priority,
            req.timeout_ms or default_timeout,
            req.metadata_json,
            round(req.delay_seconds * 1000),
            "" if sched_ms is None else sched_ms,
            "" if ttl_ms is None else ttl_ms,
            "" if exp_ms is None else exp_ms,
            new_id(),
        )
    args[5] = len(queues)
    args.append(_flag(s.submit_min_replicas > 0))  # a replay writes for the WAIT to count
    stream_keys = [k for queue in queues for k in _queue_block(queue)]
    task_keys += [keys.queue_last_submit(queue) for queue in queues]  # KEYS[T + 3n + q]
    if not keys.cluster_layout():  # a cluster batch is one queue's, registered apart
        task_keys.append(keys.QUEUES)
    scope = reqs[0].queue
    return (
        "submit",
        [
            keys.retry_schedule(scope),
            keys.recent(scope),
            keys.expiry(scope),
            *stream_keys,
            *task_keys,
        ],
        args,
    )


@dataclass(frozen=True, slots=True)
class Submitted:
    """submit.lua's replies for a batch, one per task in order, and ``replicas``: how many
    replicas WAIT saw acknowledge the batch's writes (None: no WAIT was sent, as with
    ``DTQ_SUBMIT_MIN_REPLICAS`` = 0)."""

    replies: list[SubmitReply | ResponseError]
    replicas: int | None = None
    wait_error: str = ""  # Redis refused the WAIT (disabled, renamed): replicas is then 0


async def submit(db: Backend, reqs: Sequence[SubmitRequest], ids: Sequence[str]) -> Submitted:
    """submit.lua for ``reqs`` (task ids ``ids``), all chunks in one round trip; one reply per
    task, in order. A Redis error is that task's result (a wrong-type key), or every task's of
    its chunk when the whole call failed (out of memory), so that the tasks other calls
    committed are still reported; a lost connection is raised (no outcome is known).

    With ``DTQ_SUBMIT_MIN_REPLICAS`` > 0, ``WAIT min_replicas timeout`` follows the calls on
    the same connection, in the same round trip (:meth:`Scripts.call_many_wait`; on a cluster,
    on each node's connection after its calls)."""
    s = db.settings
    groups = submit_chunks(reqs)
    batch = [_submit_call([reqs[i] for i in g], [ids[i] for i in g], s) for g in groups]
    replicas: int | None = None
    wait_error = ""
    if s.submit_min_replicas:
        try:
            chunks, replicas = await db.scripts.call_many_wait(
                db.redis, batch, s.submit_min_replicas, s.submit_replica_timeout_ms
            )
        except WaitError as exc:  # the scripts ran: their tasks are reported, unconfirmed
            chunks, replicas, wait_error = exc.results, 0, str(exc)
    else:
        chunks = await db.scripts.call_many(db.redis, batch)
    out: list[SubmitReply | ResponseError | None] = [None] * len(reqs)
    for group, chunk in zip(groups, chunks, strict=True):
        if isinstance(chunk, ResponseError):
            for i in group:
                out[i] = chunk
            continue
        if isinstance(chunk, Exception):
            raise chunk
        for i, reply in zip(group, chunk, strict=True):
            out[i] = _submit_reply(reply)
    return Submitted(cast("list[SubmitReply | ResponseError]", out), replicas, wait_error)


def _submit_reply(reply: Sequence[Any]) -> SubmitReply | ResponseError:
    kind = reply[0]
    if kind == "new":
        _, status, entry_id, now_ms, due_ms, exp_ms = reply
        exp = _int_or_none(exp_ms)
        return SubmitReply("new", status, entry_id or "", int(now_ms), int(due_ms), exp)
    if kind == "dup":
        return SubmitReply("dup", status=str(reply[1]), task_id=str(reply[2]))
    if reply[1] == "REDIS":
        return ResponseError(str(reply[2]))
    return SubmitReply("err", code=str(reply[1]), detail=str(reply[2]))


# -- read.lua -----------------------------------------------------------------------------------


def entry_key(stream: str, entry_id: str) -> str:
    """What tells a delivered entry from every other: its stream and its id. An id alone does
    not: streams make their ids apart, and two queues (or bands) given an entry in the same
    millisecond give both the same id."""
    return stream + " " + entry_id


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
    key: str = field(init=False, repr=False, compare=False)  # entry_key(stream, entry_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", self.stream + " " + self.entry_id)

    @classmethod
    def parse(cls, stream: str, entry_id: str, fields: Mapping[str, str] | None) -> Entry | None:
        """The entry, or None when its fields are missing or malformed (a foreign write; in
        the cluster layout, also a task id or queue whose keys are not in the stream's slot,
        which no script could serve: every call touches one slot)."""
        if not fields or not fields.get("task_id"):
            return None
        queue = fields.get("queue") or keys.stream_queue(stream)[0]
        if keys.cluster_layout() and not (
            keys.slot(stream)
            == keys.slot(keys.task(fields["task_id"]))
            == keys.slot(keys.cancelled(queue))
        ):
            return None
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


@dataclass(frozen=True)
class QueueKeys:
    """The keys of a queue that its start and finish scripts take, besides the task's own (the
    shared ones in the flat layout): built once per queue, layout and events choice."""

    cancelled: str
    expiry: str
    dead_letter: str
    retry_schedule: str
    events: str
    wf_outbox: str


def queue_keys(queue: str) -> QueueKeys:
    """:class:`QueueKeys` of ``queue``, cached."""
    return _queue_keys(queue, keys.cluster_layout(), keys.sharded_events())


@functools.lru_cache(maxsize=4096)
def _queue_keys(queue: str, cluster: bool, sharded: bool) -> QueueKeys:
    """:func:`queue_keys`, cached by what decides the names (the two flags are the key)."""
    return QueueKeys(
        keys.cancelled(queue),
        keys.expiry(queue),
        keys.dead_letter(queue),
        keys.retry_schedule(queue),
        keys.events(queue),
        keys.wf_outbox(queue),
    )


def parse_read(
    reply: Sequence[Any] | None,
) -> tuple[list[Entry], list[tuple[str, str]]]:
    """An XREADGROUP reply -> (entries, (stream, id) of entries whose fields are unusable)."""
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
    """The KEYS and fixed ARGV of read.lua for one worker's queues, built once: the paused
    flags, then every stream p9 first across the queues (strict priority, contract section 6).
    The script relies on that order: stream k (from 1) is queue ``(k - 1) % m + 1``'s.

    In the cluster layout one call cannot read two queues (two slots): the plan holds one plan
    per queue (``parts``), read in turn (:func:`read`)."""

    def __init__(self, queues: Sequence[str], worker_id: str) -> None:
        self.queues = list(queues)
        self.streams = [keys.stream(q, p) for p in keys.PRIORITIES for q in self.queues]
        self.keys = [*(keys.queue_paused(q) for q in self.queues), *self.streams]
        self.head: list[str] = [keys.CONSUMER_GROUP, worker_id]
        self.m = str(len(self.queues))
        self.parts: list[ReadPlan] = []
        if keys.cluster_layout() and len(self.queues) > 1:
            self.parts = [ReadPlan([q], worker_id) for q in self.queues]
        self._next = 0  # the part the next cluster read starts with


async def read(db: Backend, plan: ReadPlan, count: int) -> ReadReply:
    """read.lua: at most ``count`` entries (the slots the caller reserved) of ``plan``'s
    streams.

    Cluster layout, several queues: one call per queue, in turn until ``count`` entries are
    read, each read starting one queue further than the last (so every queue is served even
    when the first always has work): strict priority holds within each queue, and across
    queues only as far as that turn goes (docs/operations.md, "Scaling out")."""
    if not plan.parts:
        return await _read_one(db, plan, count)
    entries: list[Entry] = []
    bad: list[tuple[str, str]] = []
    nogroup: list[str] = []
    paused: set[str] = set()
    since: dict[str, str] = {}
    n = len(plan.parts)
    start = plan._next
    plan._next = (start + 1) % n
    for i in range(n):
        got = await _read_one(db, plan.parts[(start + i) % n], count - len(entries))
        entries += got.entries
        bad += got.bad
        nogroup += got.nogroup
        paused |= got.paused
        since.update(got.since)
        if len(entries) >= count:
            break
    return ReadReply(entries, bad, nogroup, frozenset(paused), {} if entries or bad else since)


async def _read_one(db: Backend, plan: ReadPlan, count: int) -> ReadReply:
    got, nogroup, paused, since = await db.scripts.call(
        db.redis, "read", plan.keys, [*plan.head, count, plan.m]
    )
    streams = plan.streams
    # {k, items, ...} with flat fields, reshaped as redis-py gives XREADGROUP for parse_read.
    entries, bad = parse_read(
        [
            (streams[int(got[i]) - 1], [(eid, _flat_fields(f)) for eid, f in got[i + 1]])
            for i in range(0, len(got), 2)
        ]
    )
    return ReadReply(
        entries,
        bad,
        [streams[int(k) - 1] for k in nogroup],
        frozenset(plan.queues[int(q) - 1] for q in paused),
        {streams[int(since[i]) - 1]: str(since[i + 1]) for i in range(0, len(since), 2)},
    )


# -- start.lua ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitUse:
    """One limit as one task meets it (docs/limits.md): its name, the prefix of its state for
    the task's key value (:func:`dtq.keys.limit_state`), GCRA's interval and tolerance in ms
    (0: no rate) and its concurrency (0: none)."""

    name: str
    prefix: str
    interval_ms: float
    tolerance_ms: float
    concurrency: int


@dataclass(frozen=True)
class StartReply:
    """start.lua's answer. ``kind`` is run, missing, terminal, cancelled, duplicate, expired,
    dead, throttled (parked by a limit: ``detail`` its name, ``reason`` rate, concurrency or
    upstream (held by a handler's ``RateLimited(slow=True)``), ``until_ms`` when it is due
    again) or fenced (the entry is not pending for this worker);
    the numbers are set for ``run``, with ``throttled_ms`` how long a limit held the task back
    before this start (None: never) and ``limits`` the places it holds."""

    kind: str
    detail: str = ""
    attempt: int = 0
    max_attempts: int = 0
    timeout_ms: int = 0
    expires_at_ms: int | None = None
    created_ms: int | None = None
    started_ms: int = 0
    throttled_ms: int | None = None
    reason: str = ""
    until_ms: int = 0
    limits: tuple[LimitUse, ...] = ()

    @classmethod
    def parse(cls, reply: Sequence[Any], limits: tuple[LimitUse, ...] = ()) -> StartReply:
        kind = str(reply[0])
        if kind == "throttled":
            return cls(kind, str(reply[1]), reason=str(reply[2]), until_ms=int(reply[3]))
        if kind != "run":
            return cls(kind, str(reply[1]) if len(reply) > 1 else "")
        _, attempt, max_attempts, timeout_ms, exp_ms, created_ms, started_ms, throttled = reply
        return cls(
            kind,
            attempt=int(attempt),
            max_attempts=int(max_attempts),
            timeout_ms=int(timeout_ms),
            expires_at_ms=_int_or_none(exp_ms),
            created_ms=_int_or_none(created_ms),
            started_ms=int(started_ms),
            throttled_ms=_int_or_none(throttled) if throttled else None,
            limits=limits,
        )


async def start_many(
    db: Backend,
    entries: Sequence[Entry],
    worker_id: str,
    token: str = "",
    resume: Mapping[str, str] | None = None,
    limits: Callable[[Entry], tuple[LimitUse, ...]] | None = None,
) -> list[StartReply | Exception]:
    """start.lua for every entry of a read batch, in one round trip; the reply or the error of
    each, in order. A lost connection is raised. ``token``: this batch's start token (kept in
    the hash of each task it runs); ``resume``: entry id -> the token of an earlier start of
    that entry whose reply was lost (by :func:`entry_key`), sent again as a resume (see the
    script's header); ``limits``: the limits each entry's task meets (none: no limit)."""
    s = db.settings
    dlq = _flag(s.dlq_enabled)
    again = resume or {}
    lone = (token, "0")  # the two last ARGV of a call that resumes nothing
    calls: list[Call] = []
    uses: list[tuple[LimitUse, ...]] = []
    for e in entries:
        qk = queue_keys(e.queue)
        call_keys = [
            keys.task(e.task_id),
            keys.history(e.task_id),
            e.stream,
            qk.cancelled,
            qk.expiry,
            keys.idempotency(e.queue, e.idempotency_key),
            qk.dead_letter,
            keys.payload(e.task_id),
            keys.done(e.task_id),
            qk.wf_outbox,
        ]
        argv: list[Any] = [
            e.task_id,
            e.entry_id,
            worker_id,
            keys.CONSUMER_GROUP,
            s.task_retention_s,
            s.idem_ttl_s,
            qk.events,
            new_id(),
            dlq,
            s.dlq_maxlen,
            *((again.get(e.key, token), _flag(e.key in again)) if again else lone),
        ]
        if limits is not None:
            use = limits(e)
            uses.append(use)
            if use:
                call_keys.append(qk.retry_schedule)
                argv.append(len(use))
                for u in use:
                    call_keys += [u.prefix + ":rate", u.prefix + ":running", u.prefix + ":waiting"]
                    argv += [u.name, u.interval_ms, u.tolerance_ms, u.concurrency]
        calls.append(("start", call_keys, argv))
    replies = await db.scripts.call_many(db.redis, calls)
    if limits is None:  # no limit anywhere on this worker's queues: the usual case
        return [r if isinstance(r, Exception) else StartReply.parse(r) for r in replies]
    return [
        r if isinstance(r, Exception) else StartReply.parse(r, use)
        for r, use in zip(replies, uses, strict=True)
    ]


# -- finish.lua ---------------------------------------------------------------------------------

OutcomeKind = Literal["success", "error", "reschedule", "cancelled", "rate_limited"]


@dataclass(frozen=True)
class Outcome:
    """How one execution ended, as finish.lua records it. ``rate_limited``: the handler raised
    :class:`~dtq_tasks.RateLimited`, parked ``delay_ms`` (and, ``slow``, its limits held as
    long) without spending the attempt."""

    kind: OutcomeKind
    duration_ms: int = 0
    result_json: str = ""
    result_too_large: bool = False
    error_class: str = ""
    error_message: str = ""
    retryable: bool = False
    delay_ms: int = 0
    extend_ms: int | None = None
    slow: bool = False
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FinishReply:
    """finish.lua's answer: ``status`` is the task's new status, or "fenced" (nothing written:
    another worker owns the entry; ``detail`` says why); a retry's ``detail`` is its delay in
    ms, and so is a rate-limited task's (``pending``: parked without spending the attempt)."""

    status: str
    detail: str = ""
    freed: bool = False  # a limit's place came free and its first waiter was made due


# The usual replies, built once: a finish allocates no reply of its own.
_FINISHED = {s: FinishReply(s) for s in ("succeeded", "failed", "dead_lettered", "cancelled")}


def finish_call(
    entry: Entry,
    attempt: int,
    outcome: Outcome,
    worker_id: str,
    settings: Settings,
    limits: Sequence[LimitUse] = (),
) -> Call:
    """The finish.lua call of one execution (sent in a batch by :func:`finish_many`);
    ``limits``: the limits its start met: the places it took, which the finish gives back, and
    the limits a ``slow`` rate-limited outcome holds."""
    s = settings
    qk = queue_keys(entry.queue)
    key_list = [
        keys.task(entry.task_id),
        keys.history(entry.task_id),
        entry.stream,
        qk.retry_schedule,
        qk.expiry,
        keys.idempotency(entry.queue, entry.idempotency_key),
        qk.dead_letter,
        keys.result(entry.task_id),
        qk.cancelled,
        keys.payload(entry.task_id),
        keys.done(entry.task_id),
        qk.wf_outbox,
    ]
    argv: list[Any] = [
        entry.task_id,
        entry.entry_id,
        worker_id,
        keys.CONSUMER_GROUP,
        attempt,
        outcome.kind,
        outcome.result_json,
        _flag(outcome.result_too_large),
        outcome.error_class,
        outcome.error_message,
        _flag(outcome.retryable),
        outcome.delay_ms,
        "" if outcome.extend_ms is None else outcome.extend_ms,
        outcome.duration_ms,
        s.task_retention_s,
        s.result_retention_s,
        s.idem_ttl_s,
        qk.events,
        new_id(),
        _flag(s.dlq_enabled),
        s.dlq_maxlen,
    ]
    if limits:
        for u in limits:
            prefix = u.prefix
            key_list += [prefix + ":rate", prefix + ":running", prefix + ":waiting"]
        argv += [len(limits), _flag(outcome.slow)]
    elif outcome.slow:  # what the handler asked is recorded, though it holds no limit
        argv += [0, "1"]
    return ("finish", key_list, argv)


async def finish_many(db: Backend, calls: Sequence[Call]) -> list[FinishReply | Exception]:
    """finish.lua calls built by :func:`finish_call`, in one round trip; the reply or the error
    of each, in order. A lost connection is raised."""
    out: list[FinishReply | Exception] = []
    for r in await db.scripts.call_many(db.redis, calls):
        if isinstance(r, Exception):
            out.append(r)
            continue
        status, detail = str(r[0]), str(r[1])
        if len(r) > 2:
            out.append(FinishReply(status, detail, freed=True))
            continue
        usual = _FINISHED.get(status) if detail == "" else None
        out.append(usual if usual is not None else FinishReply(status, detail))
    return out


# -- touch.lua ----------------------------------------------------------------------------------


def _touch_args(
    worker_id: str, owned: Sequence[tuple[str, str, str]]
) -> tuple[list[str], list[str]]:
    return (
        [k for stream, _, task_id in owned for k in (stream, keys.task(task_id))],
        [keys.CONSUMER_GROUP, worker_id, *(entry_id for _, entry_id, _ in owned)],
    )


async def touch(db: Backend, worker_id: str, owned: Sequence[tuple[str, str, str]]) -> list[str]:
    """touch.lua: renew the leases of ``owned`` ((stream, entry id, task id) triples) where this
    worker still owns them; returns those it no longer holds (:func:`entry_key`). An entry
    removed from its stream whose task hash still names this worker is not lost (touch.lua's
    header). One call
    (one per slot in the cluster layout, all in one round trip)."""
    groups = _touch_groups(owned)
    calls: list[Call] = [("touch", *_touch_args(worker_id, group)) for group in groups]
    lost: list[str] = []
    for group, reply in zip(groups, await db.scripts.call_many(db.redis, calls), strict=True):
        if isinstance(reply, Exception):
            raise reply
        lost += [entry_key(*group[int(i) - 1][:2]) for i in reply[0]]
    return lost


def _touch_groups(
    owned: Sequence[tuple[str, str, str]],
) -> list[Sequence[tuple[str, str, str]]]:
    """``owned`` as touch.lua calls take it: whole in the flat layout, by slot in the cluster
    one."""
    if not keys.cluster_layout():
        return [owned]
    by_slot: dict[int, list[tuple[str, str, str]]] = {}
    for one in owned:
        by_slot.setdefault(keys.slot(one[0]), []).append(one)
    return list(by_slot.values())


def touch_blocking(
    client: redis_sync.Redis,
    scripts: Scripts,
    worker_id: str,
    owned: Sequence[tuple[str, str, str]],
) -> tuple[list[str], list[str]]:
    """touch.lua as :func:`touch` does, from the heartbeat's thread with its own synchronous
    client (so a handler that blocks the event loop cannot stop the heartbeat). Returns the
    entries this worker no longer holds (:func:`entry_key`), and the ids of those it owned that
    were found gone from their stream (removed outside dtq; each reported once)."""
    sha = scripts.sha["touch"]
    lost_ids: list[str] = []
    deleted_ids: list[str] = []
    for group in _touch_groups(owned):
        key_list, argv = _touch_args(worker_id, group)
        try:
            lost, deleted = client.evalsha(sha, len(key_list), *key_list, *argv)
        except NoScriptError:
            client.script_load(scripts.source["touch"])
            lost, deleted = client.evalsha(sha, len(key_list), *key_list, *argv)
        lost_ids += [entry_key(*group[int(i) - 1][:2]) for i in lost]
        deleted_ids += [group[int(i) - 1][1] for i in deleted]
    return lost_ids, deleted_ids


# -- adopt.lua ----------------------------------------------------------------------------------


async def adopt(
    db: Backend, stream: str, worker_id: str, dead: str, count: int
) -> tuple[list[tuple[str, dict[str, str]]], int]:
    """adopt.lua: claim for ``worker_id`` at most ``count`` entries of ``stream`` that are
    pending for the consumer ``dead``, checking the owner in the same script; returns the
    claimed (entry id, fields) and how many pending ids had no entry left (deleted while
    pending)."""
    items, gone = await db.scripts.call(
        db.redis, "adopt", [stream], [keys.CONSUMER_GROUP, worker_id, dead, count]
    )
    return [(str(eid), _flat_fields(f)) for eid, f in items], int(gone)


# -- claim_due.lua ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claimed:
    """claim_due.lua's answer: the task ids claimed now, how many stale claims went back to the
    schedule, and the Redis time."""

    task_ids: list[str]
    stale: int
    now_ms: int


async def claim_due(db: Backend, queue: str, limit: int, stale_ms: int) -> Claimed:
    """claim_due.lua: move at most ``limit`` due schedule members to the claimed set, after
    returning claims older than ``stale_ms`` to the schedule (``queue``'s, in the cluster
    layout; the one schedule of every queue in the flat one)."""
    ids, stale, now_ms = await db.scripts.call(
        db.redis,
        "claim_due",
        [keys.retry_schedule(queue), keys.retry_claimed(queue)],
        [limit, stale_ms],
    )
    return Claimed([str(i) for i in ids], int(stale), int(now_ms))


# -- promote.lua --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromoteReply:
    """promote.lua's answer: ``kind`` queued (``status`` is the status it left: pending or
    retrying), expired (likewise), or skip (``status`` says why: not_claimed, gone, or the
    task's status)."""

    kind: str
    status: str


async def promote_many(
    db: Backend, tasks: Sequence[tuple[str, Where]]
) -> list[PromoteReply | Exception]:
    """promote.lua for each claimed (task id, where) in one round trip; the reply or the error
    of each, in order."""
    s = db.settings
    calls: list[Call] = [
        (
            "promote",
            [
                keys.task(task_id),
                keys.history(task_id),
                keys.retry_schedule(queue),
                keys.retry_claimed(queue),
                keys.expiry(queue),
                keys.stream(queue, priority),
                keys.idempotency(queue, idem),
                keys.payload(task_id),
                keys.done(task_id),
                *_queue_block(queue),
                keys.wf_outbox(queue),
            ],
            [task_id, s.task_retention_s, s.idem_ttl_s, keys.events(queue), new_id()],
        )
        for task_id, (queue, priority, idem) in tasks
    ]
    return [
        r if isinstance(r, Exception) else PromoteReply(str(r[0]), str(r[1]))
        for r in await db.scripts.call_many(db.redis, calls)
    ]


# -- expire.lua ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpireReply:
    """expire.lua's answer for one task: ``kind`` expired (``status``: the status it left;
    ``queue``, ``task_type``), skip (``status``: why), keys (it needs its stream and
    idempotency keys: ``where``), not_found, or status (``status``: its status, which cannot
    expire)."""

    kind: Literal["expired", "skip", "keys", "not_found", "status"]
    status: str = ""
    queue: str = ""
    task_type: str = ""
    where: Where | None = None


def _expire_call(
    s: Settings,
    queue: str,
    tasks: Sequence[tuple[str, Where | None]],
    mode: str,
    audit: Audit | None,
) -> Call:
    """One expire.lua call for (task id, where) pairs of ``queue``'s tasks (any tasks in the
    flat layout, whose sets are shared). A task whose ``where`` is not known yet gets its hash,
    history and old payload keys only (see the script's header)."""
    key_list = [
        keys.retry_schedule(queue),
        keys.retry_claimed(queue),
        keys.expiry(queue),
        keys.audit(queue),
    ]
    argv: list[Any] = [mode, s.task_retention_s, s.idem_ttl_s, keys.events(queue), *_audit(audit)]
    for task_id, where in tasks:
        key_list += [
            keys.task(task_id),
            keys.history(task_id),
            keys.payload(task_id),
            keys.done(task_id),
        ]
        if where is None:
            argv += [task_id, new_id(), 4]
        else:
            queue, priority, idem = where
            key_list += [
                keys.stream(queue, priority),
                keys.idempotency(queue, idem),
                keys.fair_held(queue),
                keys.wf_outbox(queue),
            ]
            argv += [task_id, new_id(), 8]
    return ("expire", key_list, argv)


def _expire_reply(one: Sequence[Any]) -> ExpireReply:
    kind = one[0]
    if kind == "expired":
        return ExpireReply("expired", str(one[1]), str(one[2]), str(one[3]))
    if kind == "keys":
        return ExpireReply("keys", where=(str(one[1]), int(one[2]), str(one[3] or "")))
    if kind == "skip":
        return ExpireReply("skip", str(one[1]))
    if one[1] == "NOT_FOUND":
        return ExpireReply("not_found")
    return ExpireReply("status", str(one[2]))


async def expire(db: Backend, task_id: str, where: Where, audit: Audit | None) -> ExpireReply:
    """expire.lua in "manual" mode: mark one not-started task EXPIRED now."""
    call = _expire_call(db.settings, where[0], [(task_id, where)], "manual", audit)
    (reply,) = await db.scripts.call(db.redis, *call)
    return _expire_reply(reply)


async def expire_sweep(
    db: Backend, queue: str, task_ids: Sequence[str], per_call: int
) -> dict[str, tuple[str, str]]:
    """expire.lua in "sweep" mode (only what is due) for ``task_ids`` (members of ``queue``'s
    expiry set: the shared one in the flat layout), ``per_call`` tasks per call, all calls in
    one round trip. The tasks are not read first: those that need their stream or idempotency
    record come back with what their keys are made of and go in a second round trip. Returns
    (queue, task_type) of each task marked EXPIRED, by task id."""
    expired: dict[str, tuple[str, str]] = {}
    todo: list[tuple[str, Where | None]] = [(tid, None) for tid in task_ids]
    while todo:
        chunks = [todo[i : i + per_call] for i in range(0, len(todo), per_call)]
        calls = [_expire_call(db.settings, queue, chunk, "sweep", None) for chunk in chunks]
        todo = []
        for chunk, reply in zip(chunks, await db.scripts.call_many(db.redis, calls), strict=True):
            if isinstance(reply, Exception):
                raise reply
            for (task_id, _), one in zip(chunk, reply, strict=True):
                got = _expire_reply(one)
                if got.kind == "expired":
                    expired[task_id] = (got.queue, got.task_type)
                elif got.where is not None:
                    todo.append((task_id, got.where))
    return expired


# -- cancel.lua ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CancelReply:
    """cancel.lua's answer: ``kind`` cancelled (``status``: the status it left), requested (it
    runs: its worker stops it), not_found, or terminal (``status``: its status)."""

    kind: Literal["cancelled", "requested", "not_found", "terminal"]
    status: str = ""


async def cancel(
    db: Backend, task_id: str, where: Where, reason: str, audit: Audit | None
) -> CancelReply:
    """cancel.lua: cancel one task, or ask its worker to stop it (``reason`` goes to its
    history)."""
    queue, priority, idem = where
    s = db.settings
    reply = await db.scripts.call(
        db.redis,
        "cancel",
        [
            keys.task(task_id),
            keys.history(task_id),
            keys.retry_schedule(queue),
            keys.retry_claimed(queue),
            keys.expiry(queue),
            keys.stream(queue, priority),
            keys.cancelled(queue),
            keys.idempotency(queue, idem),
            keys.audit(queue),
            keys.payload(task_id),
            keys.done(task_id),
            keys.fair_held(queue),
            keys.wf_outbox(queue),
        ],
        [
            task_id,
            s.task_retention_s,
            s.idem_ttl_s,
            keys.events(queue),
            new_id(),
            reason,
            *_audit(audit),
        ],
    )
    kind = reply[0]
    if kind == "cancelled":
        return CancelReply("cancelled", str(reply[1]))
    if kind == "requested":
        return CancelReply("requested")
    if reply[1] == "NOT_FOUND":
        return CancelReply("not_found")
    return CancelReply("terminal", str(reply[2]))


# -- dlq_requeue.lua, dlq_discard.lua, dlq_purge.lua --------------------------------------------


@dataclass(frozen=True)
class DlqReply:
    """dlq_requeue.lua's or dlq_discard.lua's answer: ``ok`` (requeued or discarded), else the
    refusal's ``code`` (NOT_FOUND, STATUS, STALE, DEADLINE) and ``detail`` (the status, or the
    passed expires_at)."""

    ok: bool
    code: str = ""
    detail: str = ""


def _dlq_reply(reply: Sequence[Any], ok: str) -> DlqReply:
    if reply[0] == ok:
        return DlqReply(True)
    return DlqReply(False, str(reply[1]), str(reply[2]) if len(reply) > 2 else "")


async def dlq_requeue(
    db: Backend,
    task_id: str,
    queue: str,
    idempotency_key: str,
    metadata_read: str,
    metadata_new: str,
    dlq_entry_id: str,
    audit: Audit | None,
) -> DlqReply:
    """dlq_requeue.lua: a DEAD_LETTERED task back to QUEUED with ``metadata_new``, if its
    metadata is still ``metadata_read`` (``dlq_entry_id``: its DLQ entry when the hash names
    none, "" otherwise)."""
    s = db.settings
    reply = await db.scripts.call(
        db.redis,
        "dlq_requeue",
        [
            keys.task(task_id),
            keys.history(task_id),
            keys.dead_letter(queue),
            keys.idempotency(queue, idempotency_key),
            keys.audit(queue),
            keys.expiry(queue),
            *keys.queue_streams(queue),
            keys.payload(task_id),
        ],
        [
            task_id,
            metadata_read,
            metadata_new,
            dlq_entry_id,
            s.task_retention_s,
            s.idem_ttl_s,
            keys.events(queue),
            new_id(),
            *_audit(audit),
        ],
    )
    return _dlq_reply(reply, "queued")


async def dlq_discard(
    db: Backend,
    task_id: str,
    queue: str,
    metadata_read: str,
    metadata_new: str,
    dlq_entry_id: str,
    audit: Audit | None,
) -> DlqReply:
    """dlq_discard.lua: drop the task's DLQ entry (in its ``queue``'s dead-letter stream) and
    set ``metadata_new``, if its metadata is still ``metadata_read``."""
    reply = await db.scripts.call(
        db.redis,
        "dlq_discard",
        [
            keys.task(task_id),
            keys.history(task_id),
            keys.dead_letter(queue),
            keys.audit(queue),
            keys.payload(task_id),
        ],
        [
            task_id,
            metadata_read,
            metadata_new,
            dlq_entry_id,
            db.settings.task_retention_s,
            *_audit(audit),
        ],
    )
    return _dlq_reply(reply, "discarded")


async def dlq_purge(
    db: Backend, queue: str, rows: Sequence[tuple[str, str, str, str]], audit: Audit | None
) -> int:
    """dlq_purge.lua for one chunk of the entries of ``queue``'s dead-letter stream (the one
    stream in the flat layout), (entry id, task id, metadata read, new metadata or "") each;
    with no rows, only the audit entry is written. Returns how many entries were removed."""
    call_keys = [keys.dead_letter(queue), keys.audit(queue)]
    args: list[Any] = [*_audit(audit), db.settings.task_retention_s]
    for entry_id, task_id, metadata_read, metadata_new in rows:
        call_keys += [keys.task(task_id), keys.history(task_id), keys.payload(task_id)]
        args += [entry_id, task_id, metadata_read, metadata_new]
    removed, _marked = await db.scripts.call(db.redis, "dlq_purge", call_keys, args)
    return int(removed)


# -- set_paused.lua -----------------------------------------------------------------------------


async def set_paused(db: Backend, queue: str, paused: bool, audit: Audit | None) -> bool:
    """set_paused.lua: pause or resume ``queue``; True when the state changed."""
    reply = await db.scripts.call(
        db.redis,
        "set_paused",
        [
            keys.queue_paused(queue),
            keys.audit(queue),
            *(() if keys.cluster_layout() else (keys.QUEUES,)),
        ],
        [queue, _flag(paused), keys.events(queue), new_id(), *_audit(audit)],
    )
    return bool(reply)


# -- purge_queue.lua ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PurgeCandidate:
    """One task a queue purge sends: ``entry_id`` and ``band`` of the stream entry seen ("" for
    a schedule member), its idempotency key, and the metadata read and to write ("" both for a
    hash that is gone: its orphan entry or member is removed)."""

    task_id: str
    entry_id: str
    band: str
    idempotency_key: str
    metadata_read: str
    metadata_new: str


@dataclass(frozen=True)
class QueuePurged:
    """purge_queue.lua's answer: how many tasks it cancelled, and the ids whose metadata changed
    since it was read (sent again after a new read)."""

    cancelled: int
    stale: set[str]


async def purge_queue(
    db: Backend, queue: str, candidates: Sequence[PurgeCandidate], audit: Audit | None
) -> QueuePurged:
    """purge_queue.lua for one chunk of ``queue``'s candidates; with none, only the audit entry
    is written."""
    s = db.settings
    call_keys = [
        keys.retry_schedule(queue),
        keys.retry_claimed(queue),
        keys.expiry(queue),
        keys.cancelled(queue),
        keys.audit(queue),
        *keys.queue_streams(queue),
        keys.fair_held(queue),
        keys.wf_outbox(queue),
    ]
    args: list[Any] = [queue, s.task_retention_s, s.idem_ttl_s, keys.events(queue), *_audit(audit)]
    for c in candidates:
        call_keys += [
            keys.task(c.task_id),
            keys.history(c.task_id),
            keys.idempotency(queue, c.idempotency_key),
            keys.payload(c.task_id),
            keys.done(c.task_id),
        ]
        args += [c.task_id, c.entry_id, c.band, new_id(), c.metadata_read, c.metadata_new]
    reply = await db.scripts.call(db.redis, "purge_queue", call_keys, args)
    return QueuePurged(int(reply[0]), {str(t) for t in reply[1:]})


# -- lock.lua -----------------------------------------------------------------------------------


async def lock(
    db: Backend, op: Literal["acquire", "refresh", "release"], owner: str, ttl_ms: int
) -> bool:
    """lock.lua: the scheduler's leader lock; True when, after the call, it is ``owner``'s
    (acquire, refresh) or was and is now released (release)."""
    reply = await db.scripts.call(db.redis, "lock", [keys.SCHEDULER_LOCK], [op, owner, ttl_ms])
    return bool(int(reply))


# -- drop_consumers.lua -------------------------------------------------------------------------


async def drop_consumers(
    db: Backend, drops: Sequence[tuple[str, Sequence[str]]], min_idle_ms: int = 0
) -> list[list[str] | Exception]:
    """drop_consumers.lua for each (stream, consumer names) in one round trip: delete those that
    hold no pending entry and are idle ``min_idle_ms``; the names deleted (or the error) of each
    stream, in order."""
    calls: list[Call] = [
        ("drop_consumers", [stream], [keys.CONSUMER_GROUP, min_idle_ms, *consumers])
        for stream, consumers in drops
    ]
    return [
        r if isinstance(r, Exception) else [str(c) for c in r]
        for r in await db.scripts.call_many(db.redis, calls)
    ]


# -- remove_queue.lua ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoveQueueReply:
    """remove_queue.lua's answer for one queue: ``kind`` idle (a check found its keys idle;
    ``detail`` is the mark to remove it with), removed, or busy (``detail`` says why: default,
    in_flight, waiting, recent, changed)."""

    kind: Literal["idle", "removed", "busy"]
    detail: str = ""


async def remove_queue(
    db: Backend, queues: Sequence[tuple[str, str | None]]
) -> list[RemoveQueueReply | Exception]:
    """remove_queue.lua for each (queue, mark) in one round trip: with no mark a check, else the
    removal of that queue if it is still idle and its mark unchanged; the reply or the error of
    each, in order. Idle means no activity for ``DTQ_QUEUE_IDLE_TTL_S``."""
    ttl_ms = db.settings.queue_idle_ttl_s * 1000
    calls: list[Call] = [
        (
            "remove_queue",
            [
                keys.queue_last_submit(queue),
                *keys.queue_streams(queue),
                *(
                    (
                        keys.retry_schedule(queue),
                        keys.retry_claimed(queue),
                        keys.expiry(queue),
                        keys.cancelled(queue),
                        keys.dead_letter(queue),
                        keys.schedules(queue),
                        keys.limits(queue),
                    )
                    if keys.cluster_layout()
                    else (keys.QUEUES,)
                ),
                keys.fair_held(queue),
                keys.wf_outbox(queue),
            ],
            [
                queue,
                ttl_ms,
                keys.CONSUMER_GROUP,
                "check" if mark is None else "remove",
                *(() if mark is None else (mark,)),
            ],
        )
        for queue, mark in queues
    ]
    return [
        r if isinstance(r, Exception) else RemoveQueueReply(r[0], str(r[1]) if len(r) > 1 else "")
        for r in await db.scripts.call_many(db.redis, calls)
    ]


# -- recover.lua --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LostEntry:
    """A task whose entry its hash names was found gone from its stream: what recover.lua
    needs (the hash's queue, priority, entry id and worker id)."""

    task_id: str
    queue: str
    priority: int
    entry_id: str
    worker_id: str = ""


async def recover_many(
    db: Backend, lost: Sequence[LostEntry], alive: Collection[str] = ()
) -> list[list[str] | Exception]:
    """recover.lua for each lost entry, in one round trip: a new entry for its task when the
    script finds it still lost (and a running task's worker not alive). The reply of each,
    ``["requeued", status, new entry id]`` or ``["skip", why]``, or its error, in order.
    ``alive``: in the cluster layout, the worker ids the caller just found alive (the script
    cannot read their hashes, in other slots); the flat layout's script reads them itself."""
    flat = not keys.cluster_layout()
    calls: list[Call] = [
        (
            "recover",
            [
                keys.task(one.task_id),
                keys.history(one.task_id),
                keys.stream(one.queue, one.priority),
                keys.payload(one.task_id),
                *((keys.worker(one.worker_id or "-"), keys.QUEUES) if flat else ()),
            ],
            [
                one.task_id,
                one.entry_id,
                keys.CONSUMER_GROUP,
                one.worker_id,
                keys.events(one.queue),
                new_id(),
                *(() if flat else (_flag(one.worker_id in alive),)),
            ],
        )
        for one in lost
    ]
    return [
        r if isinstance(r, Exception) else [str(x) for x in r]
        for r in await db.scripts.call_many(db.redis, calls)
    ]


# -- fire.lua, schedule_put.lua, schedule_set.lua (docs/schedules.md) -----------------------------


@dataclass(frozen=True, slots=True)
class FireCandidate:
    """One tick a fire.lua call decides: ``kind`` is ``tick`` (due by the schedule),
    ``buffered`` (a tick the buffer_one policy held back) or ``trigger`` (a manual firing);
    ``request`` and ``task_id``: the task it makes if it fires."""

    tick_ms: int
    kind: Literal["tick", "buffered", "trigger"]
    request: SubmitRequest
    task_id: str


@dataclass(frozen=True, slots=True)
class Firing:
    """What one fire.lua call is asked to do for schedule ``name`` (its tasks go to
    ``queue``): the hash's ``rev`` it was planned from, the candidates, the cursor after them
    (tick mode; None: no tick left) and the missed ticks before them (count, first, last,
    whether the count was capped)."""

    name: str
    queue: str
    rev: str
    mode: Literal["tick", "trigger"]
    last_task_id: str
    candidates: Sequence[FireCandidate]
    cursor: int | None = None
    missed: int = 0
    first_missed: int | None = None
    last_missed: int | None = None
    missed_capped: bool = False
    audit: Audit | None = None  # a manual firing's
    task_type: str = ""  # the schedule's, for the metrics of what it decided


@dataclass(frozen=True, slots=True)
class FireDecision:
    """fire.lua's word on one candidate: ``decision`` fired | duplicate | skipped_overlap |
    buffered | waiting | none | rejected; ``detail``: the lag in ms of a fired one, the code
    and message of a rejected one."""

    tick_ms: int
    decision: str
    task_id: str
    detail: str


@dataclass(frozen=True, slots=True)
class FireReply:
    """``kind`` ok | stale | paused | gone; for ok, the new rev, index score and cursor."""

    kind: str
    rev: str = ""
    score: str = ""
    cursor: str = ""
    decisions: tuple[FireDecision, ...] = ()


def _schedule_keys(name: str, queue: str) -> list[str]:
    return [keys.schedule(name, queue), keys.schedule_history(name, queue), keys.schedules(queue)]


def fire_call(f: Firing, s: Settings, history_cap: int, poll_ms: int) -> Call:
    """The fire.lua call of ``f`` (one queue's keys: one slot in the cluster layout)."""
    q = f.queue
    cands = f.candidates
    prev_key = keys.task(f.last_task_id) if f.last_task_id else keys.schedule(f.name, q) + ":-"
    head = [*_schedule_keys(f.name, q), prev_key, keys.audit(q)]
    args: list[Any] = [
        f.name,
        f.rev,
        f.mode,
        "" if f.cursor is None else f.cursor,
        f.missed,
        "" if f.first_missed is None else f.first_missed,
        "" if f.last_missed is None else f.last_missed,
        _flag(f.missed_capped),
        history_cap,
        len(cands),
        new_id(),
        poll_ms,
        *_audit(f.audit),
    ]
    for c in cands:
        args += (c.tick_ms, c.kind, new_id())
    if cands:
        _, skeys, sargs = _submit_call([c.request for c in cands], [c.task_id for c in cands], s)
    else:  # no task to make: the submit part is its header alone (fire.lua reads the channel)
        skeys = [
            keys.retry_schedule(q),
            keys.recent(q),
            keys.expiry(q),
            *_queue_block(q),
            keys.queue_last_submit(q),
            *(() if keys.cluster_layout() else (keys.QUEUES,)),
        ]
        sargs = [
            s.max_queue_depth, s.task_retention_s, s.idem_ttl_s, keys.events(q), RECENT_CAP, 1,
            _flag(s.submit_min_replicas > 0),
        ]  # fmt: skip
    return ("fire", [*head, *skeys], [*args, *sargs])


def parse_fire(reply: Any) -> FireReply:
    kind = str(reply[0])
    if kind != "ok":
        return FireReply(kind, rev=str(reply[1]) if len(reply) > 1 else "")
    return FireReply(
        kind,
        str(reply[1]),
        str(reply[2]),
        str(reply[3]),
        tuple(FireDecision(int(t), str(d), str(tid), str(x)) for t, d, tid, x in reply[4:]),
    )


async def fire(
    db: Backend, firings: Sequence[Firing], history_cap: int, poll_ms: int
) -> list[FireReply | Exception]:
    """fire.lua for each of ``firings``, in one round trip (per node on a cluster); a
    failed call is its exception, in place."""
    s = db.settings
    return await fire_calls(db, [fire_call(f, s, history_cap, poll_ms) for f in firings])


async def fire_calls(db: Backend, prepared: Sequence[Call]) -> list[FireReply | Exception]:
    """:func:`fire` of calls made beforehand by :func:`fire_call`."""
    replies = await db.scripts.call_many(db.redis, prepared)
    return [r if isinstance(r, Exception) else parse_fire(r) for r in replies]


async def schedule_put(
    db: Backend,
    name: str,
    queue: str,
    task_type: str,
    definition: str,
    spec_key: str,
    cursor: int | None,
    source: str,
    paused: bool | None,
    overlap: str,
    history_cap: int,
    audit: Audit | None,
    only: Literal["create", "update"] | None = None,
) -> tuple[str, int]:
    """schedule_put.lua: (created | updated | unchanged, rev), or (exists | missing, rev)
    when ``only`` refused."""
    flat = not keys.cluster_layout()
    outcome, rev = await db.scripts.call(
        db.redis,
        "schedule_put",
        [*_schedule_keys(name, queue), keys.audit(queue), *((keys.QUEUES,) if flat else ())],
        [
            name,
            queue,
            task_type,
            definition,
            spec_key,
            "" if cursor is None else cursor,
            source,
            "" if paused is None else _flag(paused),
            history_cap,
            keys.events(queue),
            new_id(),
            *_audit(audit),
            overlap,
            only or "",
        ],
    )
    return str(outcome), int(rev or 0)


async def schedule_set(
    db: Backend,
    name: str,
    queue: str,
    op: Literal["pause", "resume", "delete"],
    reason: str,
    history_cap: int,
    audit: Audit | None,
) -> int:
    """schedule_set.lua: 1 changed, 0 already so, -1 no such schedule."""
    return int(
        await db.scripts.call(
            db.redis,
            "schedule_set",
            [*_schedule_keys(name, queue), keys.audit(queue)],
            [name, op, reason, history_cap, keys.events(queue), new_id(), *_audit(audit)],
        )
    )


# -- wait.lua -----------------------------------------------------------------------------------


async def wait_check(db: Backend, task_ids: Sequence[str]) -> dict[str, int]:
    """wait.lua for ``task_ids``, one call per slot in the cluster layout: 0 unknown, 1
    terminal, 2 not yet (and marked ``waited``, so that its end is pushed to its done
    stream)."""
    groups: list[Sequence[str]] = [task_ids]
    if keys.cluster_layout():
        by_slot: dict[int, list[str]] = {}
        for tid in task_ids:
            by_slot.setdefault(keys.slot(keys.task(tid)), []).append(tid)
        groups = list(by_slot.values())
    calls: list[Call] = [
        ("wait", [k for tid in g for k in (keys.task(tid), keys.done(tid))], []) for g in groups
    ]
    out: dict[str, int] = {}
    for group, reply in zip(groups, await db.scripts.call_many(db.redis, calls), strict=True):
        if isinstance(reply, Exception):
            raise reply
        out.update(zip(group, (int(x) for x in reply), strict=True))
    return out


# -- progress.lua -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProgressReply:
    """progress.lua's answer: ``written`` (then ``detail`` is its ``updated_at``), or not:
    fenced, the attempt is no longer this worker's running one (``detail`` says why)."""

    written: bool
    detail: str


async def progress(
    db: Backend,
    entry: Entry,
    attempt: int,
    worker_id: str,
    fraction: float | None,
    data_json: str,
) -> ProgressReply:
    """progress.lua: store ``entry``'s task's latest progress (``data_json``: compact JSON) and
    publish TASK_PROGRESS, fenced to this worker's running ``attempt``."""
    kind, detail = await db.scripts.call(
        db.redis,
        "progress",
        [keys.task(entry.task_id), entry.stream],
        [
            entry.task_id,
            entry.entry_id,
            worker_id,
            keys.CONSUMER_GROUP,
            attempt,
            "null" if fraction is None else repr(fraction),
            data_json,
            queue_keys(entry.queue).events,
            new_id(),
        ],
    )
    return ProgressReply(str(kind) == "ok", str(detail))


# -- limit_put.lua, limit_delete.lua ------------------------------------------------------------


async def limit_put(
    db: Backend, name: str, queue: str, definition: str, audit: Audit | None
) -> str:
    """limit_put.lua: store limit ``name``'s ``definition`` (JSON) in ``queue``'s limits hash;
    ``created`` | ``updated`` | ``unchanged``."""
    flat = not keys.cluster_layout()
    return str(
        await db.scripts.call(
            db.redis,
            "limit_put",
            [
                keys.limits(queue),
                keys.audit(queue),
                keys.fair(queue),
                *((keys.QUEUES,) if flat else ()),
            ],
            [name, queue, definition, keys.events(queue), new_id(), *_audit(audit)],
        )
    )


async def limit_delete(
    db: Backend, name: str, queue: str, audit: Audit | None, state: Sequence[str] = ()
) -> bool:
    """limit_delete.lua: remove limit ``name``'s definition from ``queue``'s limits hash, and
    the ``state`` keys with it (the unkeyed state: :func:`limit_state_keys`); False when it was
    not there."""
    return bool(
        await db.scripts.call(
            db.redis,
            "limit_delete",
            [keys.limits(queue), keys.audit(queue), keys.fair(queue), *state],
            [name, queue, keys.events(queue), new_id(), *_audit(audit)],
        )
    )


# -- fair_move.lua ------------------------------------------------------------------------------

FAIR_WINDOW = 64  # _lib.lua's: the unread entries a fair queue keeps in its streams at most


@dataclass(frozen=True, slots=True)
class FairMoved:
    """One :func:`fair_move`: how many tasks went into the streams, how many are still held,
    and whether the held zset's head changed under the call (read it again)."""

    moved: int
    held: int
    stale: bool


async def fair_move(db: Backend, queue: str) -> FairMoved:
    """Read the first ``FAIR_WINDOW`` held tasks of ``queue`` (one ZRANGE), then fair_move.lua
    with them: it moves each that is still next in turn while the streams have room."""
    ids = [str(t) for t in await db.redis.zrange(keys.fair_held(queue), 0, FAIR_WINDOW - 1)]
    if not ids:
        return FairMoved(0, 0, False)
    task_keys: list[str] = []
    for task_id in ids:
        task_keys += (keys.task(task_id), keys.payload(task_id))
    moved, held, stale = await db.scripts.call(
        db.redis,
        "fair_move",
        [*keys.fair_keys(queue), *_queue_block(queue)[:10], *task_keys],
        ids,
    )
    return FairMoved(int(moved), int(held), bool(int(stale)))


async def limit_delete_state(
    db: Backend, name: str, queue: str, state: Sequence[str]
) -> int | None:
    """limit_delete.lua's second use: delete ``state`` (state keys of a deleted limit's key
    values, in ``queue``'s slot) unless a limit ``name`` exists again; how many it deleted,
    None when the limit exists again (its state is the new limit's)."""
    if not state:
        return 0
    n = int(
        await db.scripts.call(
            db.redis,
            "limit_delete",
            [keys.limits(queue), keys.audit(queue), keys.fair(queue), *state],
            [name, queue, keys.events(queue), "", "", "", "state"],
        )
    )
    return None if n < 0 else n


def limit_state_keys(prefix: str) -> list[str]:
    """The state keys of one limit (of one key value), from its prefix
    (:func:`dtq.keys.limit_state`): ``:rate``, ``:running``, ``:waiting``."""
    return [prefix + ":rate", prefix + ":running", prefix + ":waiting"]


# -- limit_sweep.lua ----------------------------------------------------------------------------


def limit_sweep_call(queue: str, prefix: str, members: Sequence[str]) -> Call:
    """The limit_sweep.lua call for one page of ``members`` of the running set of the limit
    state ``prefix`` (of ``queue``)."""
    return (
        "limit_sweep",
        [
            prefix + ":running",
            prefix + ":waiting",
            keys.retry_schedule(queue),
            *(keys.task(m) for m in members),
        ],
        list(members),
    )


async def limit_sweep_many(db: Backend, calls: Sequence[Call]) -> list[list[str] | Exception]:
    """limit_sweep.lua calls built by :func:`limit_sweep_call`, in one round trip: the task ids
    whose places each removed, or its error. A lost connection is raised."""
    return [
        r if isinstance(r, Exception) else [str(m) for m in r]
        for r in await db.scripts.call_many(db.redis, calls)
    ]


# -- workflow.lua -------------------------------------------------------------------------------


def workflow_call(s: Settings, workflow_id: str, home: str, op: str, *args: Any) -> Call:
    """The workflow.lua call of ``op`` on one workflow (docs/workflows.md)."""
    call_keys = [
        keys.workflow(workflow_id),
        keys.workflow_nodes(workflow_id),
        keys.wf_outbox(home),
        keys.audit(home),
    ]
    argv = [op, workflow_id, keys.events(home), new_id(), s.task_retention_s, *args]
    return ("workflow", call_keys, argv)


async def workflow(db: Backend, workflow_id: str, home: str, op: str, *args: Any) -> Any:
    """workflow.lua's ``op`` on one workflow (the reply is the script's)."""
    return await db.scripts.call(
        db.redis, *workflow_call(db.settings, workflow_id, home, op, *args)
    )


async def workflow_many(db: Backend, prepared: Sequence[Call]) -> list[Any]:
    """workflow.lua calls built by :func:`workflow_call`, in one round trip; the reply or the
    error of each, in order."""
    return await db.scripts.call_many(db.redis, prepared)
