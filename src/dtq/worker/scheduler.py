"""The scheduler loop: leader lock, promotion of due tasks, expiry sweep, stale workers.

Every worker runs one :class:`Scheduler`; only the holder of ``dtq:lock:scheduler`` (contract
sections 2, 4, 6) does any work. Each leader tick:

1. refreshes the lock (``lock.lua``: SET NX PX 10000, refreshed and released only by its
   holder);
2. claims due members of ``dtq:retry:schedule`` into ``dtq:retry:claimed`` (``claim_due.lua``,
   at most 100 at a time, claims older than ``DTQ_CLAIM_STALE_S`` returned first) and promotes
   every claimed task in one pipeline (``promote.lua``: stream entry and QUEUED, or EXPIRED when
   its deadline passed); a full batch is followed by another while the phase has run for less
   than ``PHASE_BUDGET_S``;
3. once a second, sweeps ``dtq:expiry`` (:func:`dtq.admin.sweep_due`: batches of 100, 25
   tasks per ``expire.lua`` call), batch after full batch at ``SWEEP_RATE`` (it sleeps between
   batches, leaving Redis and the event loop to the worker's other loops) for at most
   ``PHASE_BUDGET_S``; a sweep the budget cut short goes on at the next tick, which then starts
   at once instead of after ``scheduler_interval_s``. ``on_tick`` gets each batch's result as
   soon as it is done, with the (queue, task_type) of every task it retried or expired (the
   sweep's from its script's replies, the promoted ones' read with their keys);
4. every few seconds, removes from ``dtq:workers`` each worker whose heartbeat is older than
   three heartbeat intervals (or whose hash is gone) and publishes WORKER_STALE for it, once
   (never its own worker, and not until three heartbeat intervals after this process last
   lost Redis: every heartbeat is as old as the outage);
   and deletes the consumers of workers not alive that hold no pending entry
   (:func:`dtq.worker.consumers.drop_dead`), so consumer counts stay bounded;
5. every ``QUEUE_CHECK_MIN_MS`` to ``QUEUE_CHECK_MAX_MS`` (a tenth of
   ``DTQ_QUEUE_IDLE_TTL_S``), walks ``dtq:queues`` a page per tick and removes the idle queues
   that no live worker serves, then the ``dtq:cancelled`` members no start will need
   (:mod:`dtq.worker.idle_queues`);
6. at most every ``lost_entries.PASS_EVERY_MS`` (60 s), walks the task hashes a page per tick
   and gives a new entry to the QUEUED and RUNNING tasks whose entry was removed outside dtq
   (:mod:`dtq.worker.lost_entries`; a RUNNING one only when its worker is not alive).

A Redis call that fails because Redis is unavailable is reported to the worker's
:class:`~dtq.worker.outage.RedisOutage` (rate-limited, shared by every loop of the process) and
tried again at the next tick; a bug in a phase is logged with its trace.

All times are the Redis server's (DESIGN 5): the scripts read ``TIME``; this module asks Redis
for the time once per tick and never reads the local clock for a decision about a task (the
local monotonic clock only paces how long one phase keeps sending batches). The loop ends only
when ``stopping`` is set (or the task running it is cancelled), and then releases the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from dtq import admin, calls, keys
from dtq.calls import PromoteReply, Where
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.events import make_event
from dtq.models import format_ts
from dtq.records import stale_after_ms, worker_liveness
from dtq.store import Store
from dtq.worker.consumers import drop_dead, worker_states
from dtq.worker.idle_queues import IdleQueues, clean_cancelled
from dtq.worker.lost_entries import PASS_EVERY_MS, LostEntries
from dtq.worker.outage import TRANSIENT, RedisOutage

__all__ = [
    "CLAIM_BATCH",
    "LOCK_TTL_MS",
    "PHASE_BUDGET_S",
    "SWEEP_INTERVAL_MS",
    "Scheduler",
    "TickResult",
]

log = logging.getLogger(__name__)

LOCK_TTL_MS = 10_000  # contract section 2: SET NX PX 10000
CLAIM_BATCH = 100  # contract section 7: scheduler batch capped at 100
# A phase sends batch after full batch for at most this long, so a backlog drains at the speed
# Redis runs the scripts (each call still a batch of <= 100) while one tick stays short.
PHASE_BUDGET_S = 0.5
SWEEP_INTERVAL_MS = 1_000  # the expiry sweep runs every second (docs/expiration.md)
SWEEP_BATCH = admin.SWEEP_BATCH
# A backlog of due expirations is swept at this pace, not as fast as Redis runs the scripts:
# 100,000 due tasks within 30 s (this takes 20 s) without raising the latency of the tasks the
# worker starts meanwhile (docs/expiration.md; measured in docs/performance.md, "Expiration").
SWEEP_RATE = 5_000  # tasks/s
STALE_CHECK_MIN_MS = 1_000
STALE_CHECK_MAX_MS = 5_000
QUEUE_CHECK_MIN_MS = 1_000
QUEUE_CHECK_MAX_MS = 60_000
RELEASE_TIMEOUT_S = 2.0
JITTER = 0.2


@dataclass
class TickResult:
    """What one tick did; the ids are task ids unless named otherwise."""

    leader: bool = False
    claimed: int = 0
    stale_claims: int = 0
    promoted: list[str] = field(default_factory=list)  # delayed (PENDING) -> QUEUED
    retried: list[str] = field(default_factory=list)  # RETRYING -> QUEUED
    expired: list[str] = field(default_factory=list)  # by promote or by the sweep
    skipped: list[str] = field(default_factory=list)  # claimed but no longer promotable
    swept: bool = False
    stale_workers: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the phases that failed
    # (queue, task_type) of every task in ``retried`` and ``expired``
    labels: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, part: TickResult) -> None:
        """Fold the task lists of one batch into this tick's."""
        for name in ("promoted", "retried", "expired", "skipped", "errors"):
            getattr(self, name).extend(getattr(part, name))
        self.labels.update(part.labels)


class Scheduler:
    """The scheduler loop of one worker; see the module docstring."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        worker_id: str,
        on_tick: Callable[[TickResult], None] | None = None,
        outage: RedisOutage | None = None,
    ) -> None:
        """``on_tick``: called for each batch of a leader tick that retried or expired tasks
        (metrics), with that batch's part of the tick;
        ``outage``: the process's reporter of Redis failures (by default one of its own)."""
        self.store = store
        self.outage = outage or RedisOutage()
        self.on_tick = on_tick
        self.settings = settings
        self.worker_id = worker_id
        self.lock_ttl_ms = LOCK_TTL_MS
        self._leader = False
        self._next_sweep_ms = 0
        self._sweep_backlog = False  # the last sweep left due members for the next tick
        self._next_stale_check_ms = 0
        self._next_queue_check_ms = 0
        self._idle_queues = IdleQueues(store)
        self._next_lost_pass_ms = 0
        self._lost_entries = LostEntries(store)
        self._rng = random.Random()
        self._nudging: set[str] = set()  # scopes promote_soon is promoting now
        self._nudge_again: set[str] = set()
        self._nudges: set[asyncio.Task[None]] = set()

    @property
    def is_leader(self) -> bool:
        """True when the last tick held (or took) the leader lock."""
        return self._leader

    # -- loop -----------------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Tick every ``scheduler_interval_s`` (with jitter) until ``stopping`` is set; then
        release the leader lock and return."""
        log.info("scheduler started (worker %s)", self.worker_id)
        try:
            while not stopping.is_set():
                try:
                    await self.tick()
                except Exception:  # a bug must not end the loop; it is logged with its trace
                    log.exception("scheduler tick failed")
                delay_s = self.settings.scheduler_interval_s * (
                    1 + self._rng.uniform(-JITTER, JITTER)
                )
                if self._sweep_backlog:  # the paced sweep goes on without a pause
                    delay_s = 0.0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay_s)
            log.info("scheduler stopping (worker %s)", self.worker_id)
        finally:
            await self.release()

    async def tick(self) -> TickResult:
        """One pass: take or refresh the lock; if leader, promote, sweep and check workers."""
        result = TickResult()
        self._sweep_backlog = False  # set again by a sweep the budget cuts short
        try:
            self._leader = await self._lock("acquire")
        except TRANSIENT as exc:
            self._leader = False
            self._transient(result, "lock", exc)
            return result
        self.outage.ok("scheduler")
        result.leader = self._leader
        if not self._leader:
            return result
        await self._phase(result, "promote", self._promote_due(result))
        await self._phase(result, "housekeeping", self._housekeeping(result))
        return result

    async def release(self) -> None:
        """Give the leader lock up if this scheduler holds it (owner-checked in Lua)."""
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                released = await self._lock("release")
        except (*TRANSIENT, TimeoutError) as exc:
            log.warning("scheduler lock not released (it expires on its own): %s", exc)
            released = False
        if released:
            log.info("scheduler lock released (worker %s)", self.worker_id)
        self._leader = False

    # -- phases ---------------------------------------------------------------------------------

    async def _lock(self, op: Literal["acquire", "release"]) -> bool:
        return await calls.lock(self.store, op, self.worker_id, self.lock_ttl_ms)

    async def _promote_due(self, result: TickResult) -> None:
        stale_ms = round(self.settings.claim_stale_s * 1000)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PHASE_BUDGET_S
        for scope in await self.store.scopes():  # one schedule per queue in the cluster layout
            if loop.time() >= deadline:
                return
            await self._promote_scope(scope, stale_ms, deadline, result)

    def promote_soon(self, queue: str) -> None:
        """Promote ``queue``'s due tasks now, from any worker, not at the leader's next pass:
        a finish freed a limit's place and made its first waiter due (docs/limits.md). Calls
        made while one runs for the same scope run once more after it; claims are atomic, so
        this never races the leader into promoting a task twice."""
        scope = keys.scopes([queue])[0]
        if scope in self._nudging:
            self._nudge_again.add(scope)
            return
        self._nudging.add(scope)
        task = asyncio.ensure_future(self._nudge(scope))
        self._nudges.add(task)
        task.add_done_callback(self._nudges.discard)

    async def _nudge(self, scope: str) -> None:
        stale_ms = round(self.settings.claim_stale_s * 1000)
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._nudge_again.discard(scope)
                result = TickResult()
                await self._promote_scope(scope, stale_ms, loop.time() + PHASE_BUDGET_S, result)
                if scope not in self._nudge_again:
                    return
        except TRANSIENT as exc:  # the scheduler's pass promotes it then
            log.debug("promotion after a freed limit place failed: %s", exc)
        except Exception:
            log.exception("promotion after a freed limit place failed")
        finally:
            self._nudging.discard(scope)

    async def _promote_scope(
        self, scope: str, stale_ms: int, deadline: float, result: TickResult
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            claimed = await calls.claim_due(self.store, scope, CLAIM_BATCH, stale_ms)
            ids, stale = claimed.task_ids, claimed.stale
            result.stale_claims += stale
            if stale:
                log.warning("scheduler returned %s stale claim(s) to the schedule", stale)
            if not ids:
                return
            result.claimed += len(ids)
            part = TickResult(leader=True)
            try:
                await self._promote(scope, ids, part)
            finally:
                result.add(part)
            self._report(result, part)
            if len(ids) < CLAIM_BATCH or loop.time() >= deadline:
                return

    async def _promote(self, scope: str, ids: Sequence[str], result: TickResult) -> None:
        todo: list[tuple[str, Where]] = []
        gone: list[str] = []
        labels: dict[str, tuple[str, str]] = {}
        for tid, found in zip(ids, await self._promote_keys(ids), strict=True):
            if found is None:
                gone.append(tid)
            else:
                where, labels[tid] = found
                todo.append((tid, where))
        if gone:  # the hash expired or was deleted: nothing to promote, drop the claim
            await self.store.redis.zrem(keys.retry_claimed(scope), *gone)
            result.skipped.extend(gone)
        replies = await calls.promote_many(self.store, todo)
        for (tid, _), reply in zip(todo, replies, strict=True):
            if isinstance(reply, TRANSIENT):
                raise reply
            if isinstance(reply, Exception):  # left claimed: returned once the claim is stale
                log.error("promote of task %s failed: %s", tid, reply)
                result.errors.append(f"promote:{tid}")
                continue
            self._record(tid, reply, result)
        for tid in (*result.retried, *result.expired):
            result.labels[tid] = labels[tid]

    async def _promote_keys(
        self, ids: Sequence[str]
    ) -> Iterator[tuple[tuple[str, int, str], tuple[str, str]] | None]:
        """What each claimed task's promote needs, (queue, priority, idempotency key), and its
        labels (queue, task_type) for the tick's result: one pipeline; None where the hash is
        gone."""
        pipe = self.store.redis.pipeline(transaction=False)
        for tid in ids:
            pipe.hmget(keys.task(tid), "queue", "priority", "idempotency_key", "task_type")
        return (
            None if q is None else ((q, int(p), k or ""), (q, t or ""))
            for q, p, k, t in await pipe.execute()
        )

    @staticmethod
    def _record(task_id: str, reply: PromoteReply, result: TickResult) -> None:
        if reply.kind == "queued":
            (result.retried if reply.status == "retrying" else result.promoted).append(task_id)
        elif reply.kind == "expired":
            result.expired.append(task_id)
        else:
            result.skipped.append(task_id)

    async def _sweep(self, now_ms: int, result: TickResult) -> bool:
        """Sweep batches of ``SWEEP_BATCH`` at ``SWEEP_RATE`` (sleeping between batches, so the
        worker's other loops have Redis and the event loop meanwhile) for at most
        ``PHASE_BUDGET_S``; True when the budget, not the index, ended it."""
        result.swept = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + PHASE_BUDGET_S
        looked_at = 0
        while True:
            swept = await admin.sweep_due(self.store, now_ms, SWEEP_BATCH)
            part = TickResult(leader=True, expired=list(swept.expired), labels=swept.expired)
            result.add(part)
            self._report(result, part)
            if swept.due < SWEEP_BATCH:
                return False
            looked_at += swept.due
            resume = started + looked_at / SWEEP_RATE
            if resume >= deadline or loop.time() >= deadline:
                return True
            await asyncio.sleep(max(0.0, resume - loop.time()))

    def _stale_check_ms(self) -> int:
        beat_ms = round(self.settings.heartbeat_interval_s * 1000)
        return max(STALE_CHECK_MIN_MS, min(STALE_CHECK_MAX_MS, beat_ms))

    def _stale_limit_ms(self) -> int:
        return stale_after_ms(self.settings.heartbeat_interval_s)

    async def _stale_workers(self, now_ms: int, result: TickResult) -> None:
        redis = self.store.redis
        members = sorted(cast(set[str], await redis.smembers(keys.WORKERS)))
        members = [m for m in members if m != self.worker_id]  # this one is alive: it is here
        if not members:
            return
        states = await worker_states(self.store, members)
        limit_ms = self._stale_limit_ms()
        for wid, h in zip(members, states, strict=True):
            live = worker_liveness(h, now_ms, limit_ms)
            if not live.stale:
                continue  # alive, starting (no heartbeat yet: its hash TTL runs) or stopped
            # SREM first: of two schedulers that both saw it, only one publishes.
            if await redis.srem(keys.WORKERS, wid) != 1:
                continue
            meta: dict[str, Any] = {"reason": "heartbeat_old" if h else "hash_gone"}
            if live.beat_ms is not None:
                meta["last_heartbeat"] = format_ts(live.beat_ms)
                meta["heartbeat_age_ms"] = live.age_ms
            await redis.publish(
                keys.EVENTS,
                make_event("WORKER_STALE", worker_id=wid, metadata=meta, ts_ms=now_ms),
            )
            log.warning("worker %s is stale (%s): removed from the worker set", wid, meta)
            result.stale_workers.append(wid)

    async def _drop_consumers(self, now_ms: int) -> None:
        """Consumers of workers not alive that hold no entry, idle a visibility timeout."""
        min_idle_ms = round(self.settings.visibility_timeout_s * 1000)
        dropped = await drop_dead(self.store, now_ms, self._stale_limit_ms(), min_idle_ms)
        if not dropped:
            return
        per_worker: dict[str, int] = {}
        for _, name in dropped:
            per_worker[name] = per_worker.get(name, 0) + 1
        log.info(
            "removed %d consumer(s) of workers no longer alive, holding no entry: %s",
            len(dropped),
            ", ".join(f"{name} ({n} stream(s))" for name, n in sorted(per_worker.items())),
        )

    def _report(self, result: TickResult, part: TickResult) -> None:
        """``on_tick`` for one batch's retries and expirations, as soon as it is done: an
        observer then handles at most a batch at a time (a tick can expire thousands of tasks,
        and whatever the observer does per task would hold the event loop that long)."""
        if self.on_tick is None or not (part.retried or part.expired):
            return
        try:
            self.on_tick(part)
        except Exception:  # an observer's bug must not stop the tick
            log.exception("scheduler on_tick failed")
            result.errors.append("on_tick")

    async def _phase(self, result: TickResult, name: str, work: Awaitable[None]) -> None:
        """Run one phase; its failure is logged and does not stop the phases after it."""
        try:
            await work
        except TRANSIENT as exc:
            self._transient(result, name, exc)
        except Exception:  # a bug in one phase must not starve the others
            log.exception("scheduler %s failed", name)
            result.errors.append(name)

    async def _housekeeping(self, result: TickResult) -> None:
        now_ms = await redis_time_ms(self.store.redis)
        if now_ms >= self._next_sweep_ms:
            self._next_sweep_ms = now_ms + SWEEP_INTERVAL_MS
            if await self._sweep(now_ms, result):
                self._next_sweep_ms = now_ms  # a backlog is left: go on at the next tick
                self._sweep_backlog = True
        # Right after this process lost Redis, every worker's heartbeat is as old as the outage:
        # judge none of them until a full stale limit has passed since (they beat meanwhile).
        settled = self.outage.seconds_since_failure() * 1000 >= self._stale_limit_ms()
        if now_ms >= self._next_stale_check_ms and settled:
            self._next_stale_check_ms = now_ms + self._stale_check_ms()
            await self._stale_workers(now_ms, result)
            await self._phase(result, "consumers", self._drop_consumers(now_ms))
        if now_ms >= self._next_queue_check_ms and settled:
            await self._phase(result, "queues", self._remove_idle_queues(now_ms))
        # Whether a task's worker is alive decides a running one: judged only when settled too.
        if (self._lost_entries.cursor or now_ms >= self._next_lost_pass_ms) and settled:
            await self._phase(result, "lost_entries", self._recover_lost(now_ms))

    async def _remove_idle_queues(self, now_ms: int) -> None:
        """One page of the idle-queue pass (:mod:`dtq.worker.idle_queues`); the queues of live
        workers (their hash's ``queues``) stay whatever their state."""
        redis = self.store.redis
        members = sorted(cast(set[str], await redis.smembers(keys.WORKERS)))
        served: set[str] = set()
        if members:
            pipe = redis.pipeline(transaction=False)
            for wid in members:
                pipe.hget(keys.worker(wid), "queues")
            queues_of = await pipe.execute()
            states = await worker_states(self.store, members)
            limit_ms = self._stale_limit_ms()
            for h, names in zip(states, queues_of, strict=True):
                if worker_liveness(h, now_ms, limit_ms).alive:
                    served.update(q for q in (names or "").split(",") if q)
        removed, done = await self._idle_queues.step(served)
        if removed:
            log.info("removed %d idle queue(s): %s", len(removed), ", ".join(removed))
        every_ms = self.settings.queue_idle_ttl_s * 100  # a tenth of the idle TTL
        every_ms = max(QUEUE_CHECK_MIN_MS, min(QUEUE_CHECK_MAX_MS, every_ms))
        self._next_queue_check_ms = now_ms + every_ms if done else now_ms
        if done:  # a full pass over the registry: the cancelled set too
            cleaned = await clean_cancelled(self.store)
            if cleaned:
                log.info("removed %d dtq:cancelled member(s) of entries gone", cleaned)

    async def _recover_lost(self, now_ms: int) -> None:
        """One page of the pass over the task hashes (:mod:`dtq.worker.lost_entries`); a pass
        starts at most every ``PASS_EVERY_MS``."""
        if self._lost_entries.cursor == 0:
            self._next_lost_pass_ms = now_ms + PASS_EVERY_MS
        await self._lost_entries.step()  # each task given a new entry is logged there

    def _transient(self, result: TickResult, phase: str, exc: BaseException) -> None:
        self.outage.failed(f"scheduler {phase}", exc)  # tried again at the next tick
        result.errors.append(phase)
