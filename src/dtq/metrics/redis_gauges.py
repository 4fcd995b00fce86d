"""The gauges that live in Redis, read at scrape time by the API (:class:`RedisGauges`)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from redis.asyncio import Redis
from redis.exceptions import (
    ClusterDownError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from dtq import keys
from dtq.clock import RedisClock, local_ms
from dtq.config import Settings
from dtq.metrics.limit_gauges import LimitUse, LimitUseReader, limit_hashes
from dtq.records import (
    DEPTH_READS,
    LIVENESS_FIELDS,
    queue_depth,
    read_depth,
    stale_after_ms,
    worker_liveness,
)

__all__ = ["EXPIRING_CAP", "OpHook", "RedisGauges"]

log = logging.getLogger(__name__)

OpHook = Callable[[str, bool], None]
"""(operation, ok): told of each Redis operation, for ``dtq_redis_operations_total``."""

EXPIRING_CAP = 10_000
DEFAULT_QUEUE = "default"


@dataclass
class _Snapshot:
    """The values of one scrape."""

    depth: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    near_expiration: dict[str, int] = field(default_factory=dict)
    retry_scheduled: int = 0
    dlq_depth: int = 0
    workers_active: int = 0
    workers_stale: int = 0
    max_queue_depth: int = 0
    limits: list[LimitUse] = field(default_factory=list)


@dataclass
class _Reads:
    """What the round trips of one scrape read."""

    now_ms: int
    queues: set[str]
    workers: set[str]
    scheduled: int
    dlq: int
    expiring: list[str]
    counts: dict[str, list[Any]]  # queue -> XLEN, XPENDING, ... of its ten streams
    beats: dict[str, dict[str, Any] | None]  # worker id -> its liveness fields (None: gone)
    limit_hashes: set[str]  # the definition hashes read
    limit_defs: dict[str, str]  # limit name -> its definition's JSON


class RedisGauges:
    """A Prometheus collector of the values that live in Redis, read at scrape time.

    :meth:`refresh` (awaited by the API's ``/metrics`` before it renders) sends ONE pipeline:
    ``TIME``; ``SMEMBERS dtq:queues`` and ``dtq:workers``; ``ZCARD dtq:retry:schedule``;
    ``XLEN dtq:stream:dead-letter``; ``ZRANGEBYSCORE dtq:expiry -inf <now + window>`` (at most
    10,000 members); and, for every queue and worker known from the previous scrape, ``XLEN``
    and ``XPENDING`` of its ten streams and ``EXISTS`` and ``HMGET`` of its hash's liveness
    fields (:data:`dtq.records.LIVENESS_FIELDS`); ``HGETALL`` of the limit definitions
    (``dtq:limits``; in the cluster layout, each known queue's). A second
    round trip happens only for what the first discovered: a queue or worker not seen before,
    or an expiring task whose queue is not known yet (a task's queue never changes, so it is
    looked up once while it stays in the window). When limits are defined, one more round trip
    reads their use, and each keyed limit a SCAN (:mod:`dtq.metrics.limit_gauges`).

    ``dtq:expiry`` is one zset for all queues and holds only tasks that have not started
    (the start script removes a task's member, a retry puts it back), so near-expiration per
    queue counts the members due within ``DTQ_NEAR_EXPIRATION_S`` by their task's queue.
    Overdue members the sweep has not reached yet (within a second) are included. Past 10,000
    such members the counts cover the 10,000 soonest (a warning is logged).

    Workers (listed in ``dtq:workers``), judged by :func:`dtq.records.worker_liveness` on the
    Redis clock with this process's ``DTQ_HEARTBEAT_INTERVAL_S`` (the API must use the workers'
    interval): ``active`` are alive (a worker that has not written its first heartbeat yet
    included), ``stale`` have a heartbeat older than three intervals, or their hash is gone.

    If Redis fails, the gauges are left out of that scrape (the process's own metrics are
    still served) and ``dtq_redis_operations_total{operation="collect",result="error"}`` grows.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        on_op: OpHook | None = None,
        expiring_cap: int = EXPIRING_CAP,
        timeout_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.expiring_cap = expiring_cap
        self.timeout_s = timeout_s
        self.clock = RedisClock()
        self.round_trips = 0  # of the last refresh
        self._on_op = on_op
        self._synced = False
        self._queues: set[str] = {DEFAULT_QUEUE}
        self._workers: set[str] = set()
        self._task_queue: dict[str, str] = {}
        self._snapshot: _Snapshot | None = None
        self._warned_cap = False
        self._lock = asyncio.Lock()
        self.limit_reader = LimitUseReader()

    async def refresh(self, redis: Redis) -> None:
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout_s):
                    self._snapshot = await self._read(redis)
            except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
                self._snapshot = None
                self._op(False)
                log.warning("metrics: Redis gauges not collected: %s", exc)
                return
            self._op(True)

    def _op(self, ok: bool) -> None:
        if self._on_op is not None:
            self._on_op("collect", ok)

    async def _read(self, redis: Redis) -> _Snapshot:
        self.round_trips = 0
        if not self._synced:
            await self.clock.sync(redis)
            self._synced = True
        reads = await self._first_trip(redis)
        await self._discover(redis, reads)
        self._queues, self._workers = reads.queues, reads.workers
        known = self._task_queue
        self._task_queue = {t: known[t] for t in reads.expiring if t in known}
        snap = self._snapshot_of(reads)
        if reads.limit_defs:
            snap.limits = await self.limit_reader.read(redis, reads.limit_defs)
            self.round_trips += 1
        return snap

    async def _first_trip(self, redis: Redis) -> _Reads:
        """The one pipeline of every scrape, for the queues and workers already known."""
        window_end = self.clock.now_ms() + self.settings.near_expiration_s * 1000
        queues, workers = sorted(self._queues), sorted(self._workers)
        # The schedule, dead-letter stream and expiry index: one each in the flat layout, one
        # per queue known so far in the cluster layout (a queue listed since is read by
        # _discover, in this scrape).
        scopes = keys.scopes(queues) if keys.cluster_layout() else [""]
        pipe = redis.pipeline(transaction=False)
        pipe.execute_command("TIME")  # not .time(): a cluster pipeline refuses that name
        pipe.smembers(keys.QUEUES)
        pipe.smembers(keys.WORKERS)
        for scope in scopes:
            _shared_reads(pipe, scope, window_end, self.expiring_cap)
        for q in queues:
            read_depth(pipe, q)
        _worker_reads(pipe, workers)
        hashes = limit_hashes(queues)
        for name in hashes:
            pipe.hgetall(name)
        before_ms = local_ms()
        replies = await _execute(pipe)
        now_ms = self.clock.observe(replies[0], before_ms, local_ms())
        self.round_trips += 1
        queue_set, worker_set = replies[1:3]
        shared = replies[3 : 3 + 3 * len(scopes)]
        rest = replies[3 + 3 * len(scopes) : len(replies) - len(hashes)]
        defs = _limit_defs(replies[len(replies) - len(hashes) :])
        expiring: list[str] = []
        for scope, found in zip(scopes, shared[2::3], strict=True):
            for t in found:
                expiring.append(str(t))
                if scope:  # the cluster layout: the index says the queue
                    self._task_queue[str(t)] = scope
        split = len(queues) * PER_QUEUE
        return _Reads(
            now_ms=now_ms,
            queues=set(queue_set) | {DEFAULT_QUEUE},
            workers=set(worker_set),
            scheduled=sum(int(n) for n in shared[0::3]),
            dlq=sum(int(n) for n in shared[1::3]),
            expiring=expiring[: self.expiring_cap],
            counts=_per_queue(queues, rest[:split]),
            beats=_per_worker(workers, rest[split:]),
            limit_hashes=set(hashes),
            limit_defs=defs,
        )

    async def _discover(self, redis: Redis, reads: _Reads) -> None:
        """A second round trip, only for queues, workers or expiring tasks not seen before
        (in the cluster layout, a new queue's schedule, dead letters and expiry index too)."""
        new_queues = sorted(reads.queues - set(reads.counts))
        new_workers = sorted(reads.workers - set(reads.beats))
        unknown = [t for t in reads.expiring if t not in self._task_queue]
        if len(reads.expiring) >= self.expiring_cap and not self._warned_cap:
            self._warned_cap = True
            log.warning(
                "metrics: %d or more tasks expire within %ss: dtq_tasks_near_expiration "
                "counts the soonest %d",
                self.expiring_cap,
                self.settings.near_expiration_s,
                self.expiring_cap,
            )
        new_hashes = [h for h in limit_hashes(new_queues) if h not in reads.limit_hashes]
        if not (new_queues or new_workers or unknown):
            return
        pipe = redis.pipeline(transaction=False)
        for q in new_queues:
            read_depth(pipe, q)
        _worker_reads(pipe, new_workers)
        for tid in unknown:
            pipe.hget(keys.task(tid), "queue")
        scopes = keys.scopes(new_queues) if keys.cluster_layout() else []
        window_end = self.clock.now_ms() + self.settings.near_expiration_s * 1000
        for scope in scopes:
            _shared_reads(pipe, scope, window_end, self.expiring_cap)
        for name in new_hashes:
            pipe.hgetall(name)
        more = await _execute(pipe)
        self.round_trips += 1
        if new_hashes:
            reads.limit_defs.update(_limit_defs(more[len(more) - len(new_hashes) :]))
            more = more[: len(more) - len(new_hashes)]
        split = len(new_queues) * PER_QUEUE
        reads.counts.update(_per_queue(new_queues, more[:split]))
        beats_end = split + 2 * len(new_workers)
        reads.beats.update(_per_worker(new_workers, more[split:beats_end]))
        queues_end = beats_end + len(unknown)
        for tid, queue in zip(unknown, more[beats_end:queues_end], strict=True):
            if queue is not None:
                self._task_queue[tid] = str(queue)
        shared = more[queues_end:]
        reads.scheduled += sum(int(n) for n in shared[0::3])
        reads.dlq += sum(int(n) for n in shared[1::3])
        for scope, found in zip(scopes, shared[2::3], strict=True):
            for t in found:
                reads.expiring.append(str(t))
                self._task_queue[str(t)] = scope
        del reads.expiring[self.expiring_cap :]

    def _snapshot_of(self, reads: _Reads) -> _Snapshot:
        snap = _Snapshot(
            retry_scheduled=reads.scheduled,
            dlq_depth=reads.dlq,
            max_queue_depth=self.settings.max_queue_depth,
        )
        for q in sorted(reads.queues):
            snap.depth[q], snap.pending[q] = queue_depth(reads.counts[q])
            snap.near_expiration[q] = 0
        near = Tally(self._task_queue[t] for t in reads.expiring if t in self._task_queue)
        for q, n in near.items():
            snap.near_expiration[q] = snap.near_expiration.get(q, 0) + n
        stale_ms = stale_after_ms(self.settings.heartbeat_interval_s)
        for wid in reads.workers:
            live = worker_liveness(reads.beats.get(wid), reads.now_ms, stale_ms)
            snap.workers_active += int(live.alive)
            snap.workers_stale += int(live.stale)
        return snap

    # -- the collector side -----------------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return list(self._families(_Snapshot()))

    def collect(self) -> Iterable[Metric]:
        if self._snapshot is None:
            return []
        return list(self._families(self._snapshot))

    @staticmethod
    def _families(s: _Snapshot) -> Iterator[Metric]:
        def per_queue(name: str, doc: str, values: dict[str, int]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["queue"])
            for q, v in sorted(values.items()):
                g.add_metric([q], v)
            return g

        yield per_queue(
            "dtq_queue_depth", "Entries in the queue's streams (waiting + in flight)", s.depth
        )
        yield per_queue(
            "dtq_queue_pending", "Entries delivered and not acknowledged (XPENDING)", s.pending
        )
        yield per_queue(
            "dtq_tasks_near_expiration",
            "Waiting tasks whose deadline is within DTQ_NEAR_EXPIRATION_S",
            s.near_expiration,
        )
        yield GaugeMetricFamily(
            "dtq_retry_scheduled", "Members of dtq:retry:schedule", value=s.retry_scheduled
        )
        yield GaugeMetricFamily("dtq_dlq_depth", "Entries in the DLQ stream", value=s.dlq_depth)
        yield GaugeMetricFamily(
            "dtq_workers_active", "Workers with a fresh heartbeat", value=s.workers_active
        )
        yield GaugeMetricFamily(
            "dtq_workers_stale",
            "Workers still listed whose heartbeat is older than 3 intervals",
            value=s.workers_stale,
        )
        yield GaugeMetricFamily(
            "dtq_queue_max_depth",
            "DTQ_MAX_QUEUE_DEPTH of this API (admission limit per queue)",
            value=s.max_queue_depth,
        )
        labels = ["queue", "task_type", "limit"]
        running = GaugeMetricFamily(
            "dtq_limit_running", "Tasks holding a place of the limit (RUNNING)", labels=labels
        )
        waiting = GaugeMetricFamily(
            "dtq_limit_waiting", "Tasks parked for a place of the limit", labels=labels
        )
        for use in s.limits:
            running.add_metric([use.queue, use.task_type, use.limit], use.running)
            waiting.add_metric([use.queue, use.task_type, use.limit], use.waiting)
        yield running
        yield waiting


PER_QUEUE = DEPTH_READS


def _per_queue(queues: Sequence[str], replies: Sequence[Any]) -> dict[str, list[Any]]:
    return {q: list(replies[i * PER_QUEUE : (i + 1) * PER_QUEUE]) for i, q in enumerate(queues)}


def _shared_reads(pipe: Any, scope: str, window_end_ms: int, cap: int) -> None:
    """The schedule's size, the dead letters and the soonest expiring tasks of one scope
    (:func:`dtq.keys.scopes`): three replies."""
    pipe.zcard(keys.retry_schedule(scope))
    pipe.xlen(keys.dead_letter(scope))
    pipe.zrangebyscore(keys.expiry(scope), "-inf", window_end_ms, start=0, num=cap)


def _worker_reads(pipe: Any, workers: Sequence[str]) -> None:
    for wid in workers:
        pipe.exists(keys.worker(wid))
        pipe.hmget(keys.worker(wid), *LIVENESS_FIELDS)


def _per_worker(workers: Sequence[str], replies: Sequence[Any]) -> dict[str, dict[str, Any] | None]:
    """Each worker's liveness fields from :func:`_worker_reads`' replies (None: hash gone)."""
    out: dict[str, dict[str, Any] | None] = {}
    for i, wid in enumerate(workers):
        exists, values = replies[2 * i], replies[2 * i + 1]
        ok = exists and not isinstance(exists, Exception) and not isinstance(values, Exception)
        out[wid] = dict(zip(LIVENESS_FIELDS, values, strict=True)) if ok else None
    return out


def _limit_defs(replies: Sequence[Any]) -> dict[str, str]:
    """The definitions (limit name -> JSON) of the definition hashes' HGETALL replies."""
    out: dict[str, str] = {}
    for reply in replies:
        if isinstance(reply, dict):
            out.update({str(k): str(v) for k, v in reply.items()})
    return out


async def _execute(pipe: Any) -> list[Any]:
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    for reply in replies:
        # XPENDING on a stream (or group) that does not exist yet answers an error: that is 0.
        if isinstance(reply, (ClusterDownError, TryAgainError)) or (
            isinstance(reply, Exception) and not isinstance(reply, ResponseError)
        ):
            raise reply  # no answer is no figure: a failover must not read as empty queues
    return replies
