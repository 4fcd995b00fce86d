"""The worker: a few named, supervised loops with an ordered shutdown (contract section 6).

Loops, each cancellable and jittered:

- **poll** (two overlapping, so Redis works while Python does) and **reaper**: where entries
  come from, within free capacity (:mod:`dtq.worker.intake`);
- **cancel watcher**: every 0.25 s, one pipelined ``HGET cancel_requested`` for the running
  tasks; a requested one is stopped and finished CANCELLED within a second;
- **finisher** (:class:`~dtq.worker.finish.Finisher`) and the **scheduler**
  (:class:`~dtq.worker.scheduler.Scheduler`, leader only);
- **heartbeat** on its own thread (:mod:`dtq.worker.heartbeat`).

A loop that loses Redis tells the process's one :class:`~dtq.worker.outage.RedisOutage` (the
first failure logged at once, then at most a line a second, then one line when Redis answers)
and starts again once Redis answers a PING; a bug is logged with its trace and the loop started
again.

What is in flight, and the slots, are the :class:`~dtq.worker.execution.Executor`'s: the start
scripts of one read go to Redis in one pipeline, each started entry runs as its own asyncio
task and its finish script joins the finisher's next pipeline (the path of one task, file by
file, is in the :mod:`dtq.worker` docstring). Shutdown (:meth:`Worker.stop`): stop intake
and the scheduler, wait up to ``DTQ_DRAIN_TIMEOUT_S`` for in-flight work, stop what is left
*without* acknowledging it (a peer reclaims it), flush finishes, delete its consumers that hold
no entry (:mod:`dtq.worker.consumers`), heartbeat to the end, then status stopped and
WORKER_STOPPED.

**One worker per id.** Fencing is by consumer name, the worker id: two live workers with one
``DTQ_WORKER_ID`` would each renew and finish the other's entries. Before its first heartbeat a
worker reads the hash of its id (:func:`~dtq.worker.consumers.worker_states`, judged by
:func:`~dtq.records.worker_liveness`): none, stopped or stale, it starts. A fresh one may be a
live worker or a crashed one whose last beat is young, so it watches that hash: a new beat
means a live worker, and it refuses to start (:class:`~dtq.errors.ConfigError`; ``dtq worker
run`` exits 2); no beat until the hash is stale (at most three heartbeat intervals) means the
other is dead, and it starts. A supervised child that takes its own id over (the supervisor
reaped the process that had it, ``adopt``) skips the check (docs/operations.md, "Worker ids").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from redis.asyncio import Redis, RedisCluster

from dtq import keys
from dtq.admin.limits import sync_code_limits
from dtq.admin.schedules import sync_code_schedules
from dtq.calls import Audit, FireReply, Firing
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.connection import choose_events, warn_durability
from dtq.errors import ConfigError
from dtq.records import stale_after_ms, worker_liveness
from dtq.schedules import ScheduleDef
from dtq.scripts import OpHook, Scripts
from dtq.store import Store
from dtq.worker.connection import worker_redis
from dtq.worker.consumers import drop_own, worker_states
from dtq.worker.execution import Executor
from dtq.worker.firer import Firer
from dtq.worker.heartbeat import Heartbeat
from dtq.worker.intake import BLOCK_MS, READ_BATCH, Intake
from dtq.worker.limits import REFRESH_S as LIMITS_REFRESH_S
from dtq.worker.limits import PlaceSweeper
from dtq.worker.observer import PlacesSwept, ScheduleDecisions, SchedulerBatch, WorkerObserver
from dtq.worker.outage import TRANSIENT, RedisOutage
from dtq.worker.scheduler import Scheduler, TickResult
from dtq.worker.workflows import WorkflowRelay
from dtq_tasks import Handler, code_limits, code_schedules, registry

__all__ = ["READ_BATCH", "Worker", "WorkerObserver", "new_worker_id"]

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.25
JITTER = 0.2
POLL_LOOPS = 2
PROBE_S = 1.0  # a loop that lost Redis pings it this often before it starts again
LEAVE_TIMEOUT_S = 5.0


def new_worker_id() -> str:
    return "worker-" + uuid.uuid4().hex[:8]


class Worker:
    """One worker process's engine. ``await run()``; ``stop()`` from a signal handler."""

    def __init__(
        self,
        settings: Settings,
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int | None = None,
        handlers: Mapping[str, Handler] | None = None,
        worker_id: str | None = None,
        observers: Iterable[WorkerObserver] = (),
        redis: Redis | None = None,
        on_redis_op: OpHook | None = None,
        adopt: Sequence[str] = (),
        schedules: Mapping[str, ScheduleDef] | None = None,
    ) -> None:
        """``adopt``: worker ids known to be dead (a supervised process that exited) whose
        pending entries this worker takes over at start, without waiting for the visibility
        timeout (:meth:`Intake.adopt`). ``schedules``: the schedules declared in code, by name
        (by default those of ``@task(..., schedule=...)`` whose task is in ``handlers``)."""
        if not queues:
            raise ValueError("a worker needs at least one queue")
        self.settings = settings
        self.queues = list(dict.fromkeys(queues))
        self.concurrency = concurrency or settings.worker_concurrency
        self.handlers = handlers if handlers is not None else registry()
        if schedules is None:
            schedules = {n: d for n, d in code_schedules().items() if d.task_type in self.handlers}
        self.schedules = dict(schedules)
        self.worker_id = worker_id or settings.worker_id or new_worker_id()
        self.observers = list(observers)
        self.redis = redis or worker_redis(settings)
        self.scripts = Scripts(on_call=on_redis_op)
        self.store = Store(self.redis, self.scripts, settings, set(self.handlers))
        self.clock = RedisClock()
        self._stopping = asyncio.Event()  # stop intake
        self._force = asyncio.Event()  # skip the rest of the drain
        self._scheduler_stop = asyncio.Event()
        self._rng = random.Random()
        # One reporter for every loop of the process, the heartbeat thread's too (outage.py).
        self.outage = RedisOutage()
        self._adopt = [a for a in adopt if a]
        self.execution = Executor(
            worker_id=self.worker_id,
            settings=settings,
            store=self.store,
            handlers=self.handlers,
            observers=self.observers,
            concurrency=self.concurrency,
            clock=self.clock,
            outage=self.outage,
            rng=self._rng,
            queues=self.queues,
        )
        self.inflight = self.execution.inflight
        self._sweeper = PlaceSweeper(
            self.store, self.execution.limits, settings.limit_sweep_s, self._places_swept
        )
        self.intake = Intake(
            self.store, settings, self.worker_id, self.queues, self.execution, self._stopping
        )
        self.workflows = WorkflowRelay(
            self.store, self.worker_id, self.queues, settings.visibility_timeout_s
        )
        self.heartbeat = Heartbeat(
            settings,
            self.scripts,
            self.worker_id,
            self.queues,
            self.concurrency,
            self.clock,
            snapshot=self.execution.snapshot,
            stats=self._stats,
            on_lost=self.execution.on_lost,
            outage=self.outage,
        )
        self.started = asyncio.Event()  # the loops run
        self.prepared = asyncio.Event()  # connected, scripts and groups ready, heartbeating

    # -- public control -------------------------------------------------------------------------

    def stop(self) -> None:
        """Begin a graceful shutdown; a second call skips what is left of the drain."""
        if self._stopping.is_set():
            if not self._force.is_set():
                log.warning(
                    "worker %s: second stop request: not waiting for the drain", self.worker_id
                )
            self._force.set()
        self._stopping.set()

    @property
    def active_tasks(self) -> int:
        return self.execution.active

    async def run(self) -> None:
        """Run until :meth:`stop`; returns after the ordered shutdown."""
        try:
            if not await self._prepare():  # stopped while it waited for its id to be free
                await self.redis.aclose()
                return
            await asyncio.to_thread(self.heartbeat.start, asyncio.get_running_loop())
            self.prepared.set()
        except BaseException:
            await self.redis.aclose()
            raise
        try:
            await self._serve()
        finally:
            await asyncio.to_thread(self.heartbeat.stop)
            self.execution.threads.shutdown()
            await self.redis.aclose()
            self.outage.flush()
            log.info(
                "worker %s stopped (%d processed, %d failed, %d retried)",
                self.worker_id,
                self.execution.finisher.tasks_processed,
                self.execution.finisher.tasks_failed,
                self.execution.finisher.tasks_retried,
            )

    async def _serve(self) -> None:
        finisher = asyncio.create_task(self.execution.finisher.run(), name="finisher")
        leader = Scheduler(
            self.store,
            self.settings,
            self.worker_id,
            on_tick=self._scheduler_ticked,
            outage=self.outage,
        )
        scheduler = asyncio.create_task(leader.run(self._scheduler_stop), name="scheduler")
        self.execution.finisher.on_freed = leader.promote_soon
        firer = asyncio.create_task(
            Firer(
                self.store,
                lambda: leader.is_leader,
                on_fired=self._schedules_fired,
                outage=self.outage,
            ).run(self._scheduler_stop),
            name="firer",
        )
        try:  # the limits apply from the first start (then read again every second)
            await self.execution.limits.refresh()
        except TRANSIENT as exc:
            self.outage.failed("limits", exc)
        await self._take_over_dead()  # before the poll loops: their slots go to these first
        intake = [
            asyncio.create_task(self._supervise("poll", self._poll), name=f"poll{i}")
            for i in range(POLL_LOOPS if self.concurrency > 1 else 1)
        ]
        intake.append(asyncio.create_task(self._supervise("reaper", self._reap), name="reaper"))
        watcher = asyncio.create_task(self._supervise("cancel", self._cancel_loop))
        intake.append(asyncio.create_task(self._supervise("limits", self._limits_loop)))
        intake.append(asyncio.create_task(self._supervise("fair", self._fair_loop)))
        intake.append(asyncio.create_task(self._supervise("workflows", self._workflow_loop)))
        try:
            self.heartbeat.set_status("running")
            await asyncio.to_thread(self.heartbeat.publish_started)
            log.info(
                "worker %s started: queues %s, concurrency %d, %d task type(s)",
                self.worker_id,
                ",".join(self.queues),
                self.concurrency,
                len(self.handlers),
            )
            self.started.set()
            await self._stopping.wait()
            await self._drain(intake)
        finally:
            self.execution.finisher.close()
            for t in intake:
                t.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(finisher), timeout=10)
            self._scheduler_stop.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(scheduler), timeout=5)
            for t in (finisher, scheduler, firer, watcher):
                t.cancel()
            await asyncio.gather(
                finisher, scheduler, firer, watcher, *intake, return_exceptions=True
            )
            await self._leave_groups()

    # -- start and stop -------------------------------------------------------------------------

    async def _prepare(self) -> bool:
        """Connect and set up; False when the worker was stopped before its id was free."""
        await self.redis.ping()
        await choose_events(self.redis)
        await self.clock.sync(self.redis)
        if not await self._check_id_free():  # before anything is written
            return False
        await self.scripts.load(self.redis)
        for queue in self.queues:
            await self.store.ensure_groups(queue)
        await warn_durability(self.redis, log)
        await self._sync_schedules()
        await sync_code_limits(
            self.store, code_limits(), self.handlers, audit=Audit(f"worker:{self.worker_id}")
        )
        return True

    async def _sync_schedules(self) -> None:
        """Create or update the schedules the handlers' code declares; pause (and report) the
        ones from code it no longer declares (docs/schedules.md, "Schedules in code")."""
        declared = self.schedules
        outcomes, paused = await sync_code_schedules(
            self.store, declared, set(self.handlers), audit=Audit(f"worker:{self.worker_id}")
        )
        for name, outcome in sorted(outcomes.items()):
            if outcome != "unchanged":
                log.info("worker %s: schedule %s %s from code", self.worker_id, name, outcome)
        for name in paused:
            log.warning(
                "worker %s: schedule %s was declared in code that no longer declares it: paused "
                "(delete it, or resume it to keep it firing)",
                self.worker_id,
                name,
            )

    async def _check_id_free(self) -> bool:
        """True once no live worker has this worker's id, False if stopped while it waits for
        that; raises ConfigError when a live worker has it (see the module docstring)."""
        if self.worker_id in self._adopt:
            return True  # its last holder is a process the supervisor reaped
        stale_ms = stale_after_ms(self.settings.heartbeat_interval_s)
        [h] = await worker_states(self.store, [self.worker_id])
        live = worker_liveness(h, self.clock.now_ms(), stale_ms)
        if not live.alive:
            return True
        seen_ms = live.beat_ms
        log.warning(
            "worker %s: a worker with this id heartbeated %s ago: waiting for its next beat (it "
            "runs: this one does not start) or for its hash to go stale (it died: this one "
            "starts)",
            self.worker_id,
            "?" if live.age_ms is None else f"{live.age_ms / 1000:.1f}s",
        )
        poll_s = min(1.0, max(0.02, self.settings.heartbeat_interval_s / 4))
        while True:
            await self._sleep(poll_s)
            if self._stopping.is_set():
                return False
            [h] = await worker_states(self.store, [self.worker_id])
            live = worker_liveness(h, self.clock.now_ms(), stale_ms)
            if not live.alive:
                log.info("worker %s: the previous holder of this id is gone", self.worker_id)
                return True
            if live.beat_ms != seen_ms:
                found = await self.redis.hmget(keys.worker(self.worker_id), "hostname", "pid")
                host, pid = cast(list[str | None], found)
                raise ConfigError(
                    f"worker id {self.worker_id} is in use by a live worker (host {host or '?'}, "
                    f"pid {pid or '?'}): give each worker its own DTQ_WORKER_ID, or leave it "
                    "unset for a generated one"
                )

    async def _drain(self, intake: Sequence[asyncio.Task[None]]) -> None:
        """Stop intake and scheduling, wait for in-flight work up to the drain timeout, then stop
        what is left without acknowledging it (a peer's reaper takes it over)."""
        log.info("worker %s draining: %d task(s) in flight", self.worker_id, len(self.inflight))
        self.heartbeat.set_status("draining")
        self._scheduler_stop.set()
        # The poll loops see the stop within one BLOCK; reads already made are still started.
        await asyncio.wait(intake, timeout=BLOCK_MS / 1000 + 1.0)
        for t in intake:
            t.cancel()
        await asyncio.gather(*intake, return_exceptions=True)
        pending = set(self.execution.executions)
        if pending and not self._force.is_set():
            drained = asyncio.ensure_future(asyncio.wait(pending))
            forced = asyncio.ensure_future(self._force.wait())
            await asyncio.wait(
                {drained, forced},
                timeout=self.settings.drain_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            drained.cancel()  # stops the waiting only, never the executions
            forced.cancel()
        left = [ex for ex in self.inflight.values() if ex.cancel("shutdown")]
        if left:
            log.warning(
                "worker %s: drain timeout: %d task(s) left unacknowledged for another worker",
                self.worker_id,
                len(left),
            )
        if self.execution.executions:
            await asyncio.wait(set(self.execution.executions), timeout=5)

    async def _leave_groups(self) -> None:
        """Delete this worker's consumers that hold no entry (consumers.py); one that holds an
        entry left by the drain stays until a peer has claimed it and the leader removes it."""
        try:
            async with asyncio.timeout(LEAVE_TIMEOUT_S):
                kept = await drop_own(self.store, self.worker_id, self.queues)
        except (*TRANSIENT, TimeoutError) as exc:
            log.warning(
                "worker %s: consumers not removed (Redis unavailable: %s); the scheduler leader "
                "removes them once this worker's heartbeat has expired",
                self.worker_id,
                exc,
            )
            return
        except Exception:
            log.exception("worker %s: consumers not removed", self.worker_id)
            return
        if kept:
            log.info(
                "worker %s: consumer kept on %s: it holds entries that a peer claims after the "
                "visibility timeout",
                self.worker_id,
                ", ".join(kept),
            )

    async def _supervise(self, name: str, body: Any) -> None:
        """Run one loop. Redis unavailable: reported (rate-limited, :mod:`dtq.worker.outage`),
        then the loop starts again once Redis answers a PING. A bug is logged with its trace
        and the loop started again a second later."""
        what = f"{name} loop"
        while not self._stopping.is_set():
            try:
                await body()
                return
            except asyncio.CancelledError:
                raise
            except TRANSIENT as exc:
                self.outage.failed(what, exc)
                await self._until_redis_answers(what)
            except Exception:
                log.exception("%s failed; restarting it", what)
                await self._sleep(1.0)

    async def _until_redis_answers(self, what: str) -> None:
        """Ping Redis every ``PROBE_S`` (jittered) until it answers or the worker stops."""
        while True:
            await self._sleep(PROBE_S)
            if self._stopping.is_set():
                return
            try:
                await self.redis.ping()
            except TRANSIENT as exc:
                self.outage.failed(what, exc)
                continue
            self.outage.ok(what)
            # Idle pooled connections that predate the outage may be dead (Redis restarted):
            # closed now, they reconnect when next used instead of failing a loop once more.
            if isinstance(self.redis, RedisCluster):  # its nodes' pools; and a new slot table
                await self.redis.nodes_manager.initialize()
            else:
                await self.redis.connection_pool.disconnect(inuse_connections=False)
            return

    async def _sleep(self, seconds: float) -> None:
        """Sleep with jitter, returning early when the worker stops."""
        delay = seconds * (1 + self._rng.uniform(-JITTER, JITTER))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    # -- intake -------------------------------------------------------------------------------

    async def _poll(self) -> None:
        await self.intake.poll()

    async def _reap(self) -> None:
        await self.intake.reap(self._jittered_reaper_interval)

    def _jittered_reaper_interval(self) -> float:
        return self.settings.reaper_interval_s * (1 + self._rng.uniform(-JITTER, JITTER))

    async def _take_over_dead(self) -> None:
        if not self._adopt:
            return
        try:
            await self.intake.adopt(self._adopt)
        except TRANSIENT as exc:  # the reaper takes them after the visibility timeout
            self.outage.failed("take-over of a dead process's entries", exc)

    async def reap_once(self) -> int:
        """One reaper pass now (tests, operators): on a busy worker it waits for the slots its
        claimable entries need (ahead of the poll loops); returns how many it started."""
        return await self.intake.reap_once()

    # -- cancellation -----------------------------------------------------------------------

    async def _limits_loop(self) -> None:
        """Read the limits of this worker's queues every second, and sweep their places every
        ``DTQ_LIMIT_SWEEP_S`` (jittered; docs/limits.md)."""
        loop = asyncio.get_running_loop()
        sweep_s = self.settings.limit_sweep_s
        next_sweep = loop.time() + sweep_s * self._rng.uniform(0.5, 1.0)
        while True:
            await self._sleep(LIMITS_REFRESH_S)
            if self._stopping.is_set():
                return  # with the intake: a stopping worker starts nothing more
            await self.execution.limits.refresh()
            if loop.time() >= next_sweep:
                next_sweep = loop.time() + sweep_s * (1 + self._rng.uniform(-JITTER, JITTER))
                await self._sweeper.sweep()

    def _places_swept(self, event: PlacesSwept) -> None:
        for obs in self.observers:
            obs.places_swept(event)

    async def _fair_loop(self) -> None:
        """Move the held tasks of the fair queues into their streams (docs/limits.md)."""
        await self.execution.fair.run(self._stopping)

    async def _workflow_loop(self) -> None:
        """Relay the ends of workflow nodes to their workflows (docs/workflows.md)."""
        await self.workflows.run(self._stopping)

    async def _cancel_loop(self) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_S * (1 + self._rng.uniform(-JITTER, JITTER)))
            await self.execution.check_cancellations()

    def _scheduler_ticked(self, part: TickResult) -> None:
        if not self.observers:
            return
        labels = part.labels
        event = SchedulerBatch(
            retried=tuple(labels[t] for t in part.retried if t in labels),
            expired=tuple(labels[t] for t in part.expired if t in labels),
        )
        for obs in self.observers:
            obs.scheduler_batch(event)

    def _schedules_fired(self, done: Sequence[tuple[Firing, FireReply]]) -> None:
        if not self.observers:
            return
        decisions: list[tuple[str, str, str, int, float | None]] = []
        for firing, reply in done:
            q, t = firing.queue, firing.task_type
            if reply.kind != "ok":
                continue
            if firing.missed:
                decisions.append((q, t, "missed", firing.missed, None))
            for d in reply.decisions:
                if d.decision == "fired":
                    decisions.append((q, t, "fired", 1, int(d.detail) / 1000))
                elif d.decision in ("skipped_overlap", "rejected"):
                    decisions.append((q, t, d.decision, 1, None))
        if not decisions:
            return
        event = ScheduleDecisions(tuple(decisions))
        for obs in self.observers:
            obs.schedules_fired(event)

    def _stats(self) -> dict[str, Any]:
        return {
            "active_tasks": self.active_tasks,
            "tasks_processed": self.execution.finisher.tasks_processed,
            "tasks_failed": self.execution.finisher.tasks_failed,
            "tasks_retried": self.execution.finisher.tasks_retried,
        }
