"""The worker: a few named, supervised loops with an ordered shutdown (contract section 6).

Loops, each cancellable and jittered:

- **poll** (two overlapping, so Redis works while Python does): strict priority p9 -> p0 across
  the served queues; each read takes at most ``min(free capacity, 64)`` entries and a stream is
  read only while capacity is left, so prefetch never exceeds free capacity. Paused queues are
  skipped (their flag is re-read at least twice a second). With nothing to read, one
  ``XREAD BLOCK 500`` on every served stream (from the group's last-delivered ids: it consumes
  nothing) wakes the worker as soon as any priority gets an entry.
- **reaper**: ``XAUTOCLAIM`` p9 -> p0 with min-idle = visibility timeout, following the cursor
  to ``0-0``, never claiming more than free capacity. Entries whose fields are gone (Redis 6.2
  replies nil) are found in this consumer's pending list, acknowledged and logged; ids that
  Redis 7 reports deleted are logged.
- **cancel watcher**: every 0.25 s, one pipelined ``HGET cancel_requested`` for the running
  tasks; a requested one is stopped and finished CANCELLED within a second.
- **finisher** (:class:`~dtq.worker.executor.Finisher`) and the **scheduler**
  (:class:`~dtq.worker.scheduler.Scheduler`, leader only).
- **heartbeat** on its own thread (:mod:`dtq.worker.heartbeat`).

Start scripts of one read go to Redis in one pipeline. Shutdown (:meth:`Worker.stop`): stop
intake and the scheduler, wait up to ``DTQ_DRAIN_TIMEOUT_S`` for in-flight work, stop what is
left *without* acknowledging it (a peer reclaims it), flush finishes, heartbeat to the end, then
status stopped and WORKER_STOPPED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq import keys
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.log import bind as bind_log_fields
from dtq.scripts import OpHook, Scripts
from dtq.store import Store
from dtq.worker.executor import Execution, Finisher, ThreadRunner, run_handler
from dtq.worker.heartbeat import Heartbeat
from dtq.worker.protocol import Entry, Outcome, StartReply, finish_call, parse_read, start_call
from dtq.worker.scheduler import Scheduler, TickResult
from dtq_tasks import Handler, registry

__all__ = ["READ_BATCH", "Worker", "WorkerObserver", "new_worker_id"]

log = logging.getLogger(__name__)

READ_BATCH = 64
BLOCK_MS = 500
PAUSE_REFRESH_S = 0.5
CANCEL_POLL_S = 0.25
JITTER = 0.2
POLL_LOOPS = 2
TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)


def new_worker_id() -> str:
    return "worker-" + uuid.uuid4().hex[:8]


class WorkerObserver:
    """Lifecycle hooks (metrics, logs, tests subscribe); the default does nothing.

    Called on the event loop; an observer must not block or raise.
    """

    def task_started(self, entry: Entry, start: StartReply) -> None:
        """A handler is about to run."""

    def task_skipped(self, entry: Entry, start: StartReply) -> None:
        """The start checks consumed an entry without running it (kind in ``start.kind``)."""

    def task_finished(
        self, ex: Execution, status: str, duration_ms: int, outcome: Outcome | None = None
    ) -> None:
        """finish.lua recorded ``status`` (or ``fenced``); ``outcome`` is how the run ended."""

    async def scheduler_ticked(self, result: TickResult, redis: Redis) -> None:
        """This worker's scheduler (the leader) retried or expired tasks in one tick."""


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
    ) -> None:
        if not queues:
            raise ValueError("a worker needs at least one queue")
        self.settings = settings
        self.queues = list(dict.fromkeys(queues))
        self.concurrency = concurrency or settings.worker_concurrency
        self.handlers = handlers if handlers is not None else registry()
        self.worker_id = worker_id or settings.worker_id or new_worker_id()
        self.observers = list(observers)
        self.redis = redis or Redis.from_url(
            settings.redis_url,
            decode_responses=True,
            socket_connect_timeout=5,
            socket_timeout=max(10.0, 4 * BLOCK_MS / 1000),
            health_check_interval=30,
        )
        self.scripts = Scripts(on_call=on_redis_op)
        self.store = Store(self.redis, self.scripts, settings, set(self.handlers))
        self.clock = RedisClock()
        self.inflight: dict[str, Execution] = {}
        self.tasks_processed = 0
        self.tasks_failed = 0
        self.tasks_retried = 0
        self._free = self.concurrency
        self._free_changed = asyncio.Event()
        self._stopping = asyncio.Event()  # stop intake
        self._force = asyncio.Event()  # skip the rest of the drain
        self._scheduler_stop = asyncio.Event()
        self._executions: set[asyncio.Task[None]] = set()
        self._paused: set[str] = set()
        self._paused_at = -1.0
        self._rng = random.Random()
        self._threads: ThreadRunner | None = None
        self._finisher = Finisher(self.store, retry_budget_s=settings.visibility_timeout_s / 2)
        self._heartbeat: Heartbeat | None = None
        self.started = asyncio.Event()

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
        return self.concurrency - self._free

    async def run(self) -> None:
        """Run until :meth:`stop`; returns after the ordered shutdown."""
        loop = asyncio.get_running_loop()
        self._threads = ThreadRunner(loop, self.concurrency)
        try:
            await self._prepare()
            self._heartbeat = Heartbeat(
                self.settings,
                self.scripts,
                self.worker_id,
                self.queues,
                self.concurrency,
                self.clock,
                snapshot=self._snapshot,
                stats=self._stats,
                on_lost=lambda ids: self._lost_from_thread(loop, ids),
            )
            await asyncio.to_thread(self._heartbeat.start)
        except BaseException:
            await self.redis.aclose()
            raise
        try:
            await self._serve()
        finally:
            await asyncio.to_thread(self._heartbeat.stop)
            self._threads.shutdown()
            await self.redis.aclose()
            log.info(
                "worker %s stopped (%d processed, %d failed, %d retried)",
                self.worker_id,
                self.tasks_processed,
                self.tasks_failed,
                self.tasks_retried,
            )

    async def _serve(self) -> None:
        assert self._heartbeat is not None
        finisher = asyncio.create_task(self._finisher.run(), name="finisher")
        scheduler = asyncio.create_task(
            Scheduler(
                self.store, self.settings, self.worker_id, on_tick=self._scheduler_ticked
            ).run(self._scheduler_stop),
            name="scheduler",
        )
        intake = [
            asyncio.create_task(self._supervise("poll", self._poll_loop), name=f"poll{i}")
            for i in range(POLL_LOOPS if self.concurrency > 1 else 1)
        ]
        intake.append(asyncio.create_task(self._supervise("reaper", self._reaper_loop)))
        watcher = asyncio.create_task(self._supervise("cancel", self._cancel_loop))
        try:
            self._heartbeat.set_status("running")
            await asyncio.to_thread(self._heartbeat.publish_started)
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
            self._finisher.close()
            for t in intake:
                t.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(finisher), timeout=10)
            self._scheduler_stop.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(scheduler), timeout=5)
            for t in (finisher, scheduler, watcher):
                t.cancel()
            await asyncio.gather(finisher, scheduler, watcher, *intake, return_exceptions=True)

    # -- start and stop -------------------------------------------------------------------------

    async def _prepare(self) -> None:
        await self.redis.ping()
        await self.clock.sync(self.redis)
        await self.scripts.load(self.redis)
        for queue in self.queues:
            await self.store.ensure_groups(queue)
        await self._warn_durability()

    async def _warn_durability(self) -> None:
        try:
            policy = await self.redis.config_get("maxmemory-policy")
            aof = await self.redis.config_get("appendonly")
        except ResponseError:  # CONFIG renamed or disabled (managed Redis): nothing to check
            return
        if policy.get("maxmemory-policy", "noeviction") != "noeviction":
            log.warning(
                "Redis maxmemory-policy is %s: Redis may evict task data; use noeviction",
                policy.get("maxmemory-policy"),
            )
        if aof.get("appendonly") != "yes":
            log.warning("Redis AOF is off: accepted tasks are lost if Redis restarts")

    async def _drain(self, intake: Sequence[asyncio.Task[None]]) -> None:
        """Stop intake and scheduling, wait for in-flight work up to the drain timeout, then stop
        what is left without acknowledging it (a peer's reaper takes it over)."""
        assert self._heartbeat is not None
        log.info("worker %s draining: %d task(s) in flight", self.worker_id, len(self.inflight))
        self._heartbeat.set_status("draining")
        self._scheduler_stop.set()
        # The poll loops see the stop within one BLOCK; reads already made are still started.
        await asyncio.wait(intake, timeout=BLOCK_MS / 1000 + 1.0)
        for t in intake:
            t.cancel()
        await asyncio.gather(*intake, return_exceptions=True)
        pending = set(self._executions)
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
        if self._executions:
            await asyncio.wait(set(self._executions), timeout=5)

    async def _supervise(self, name: str, body: Any) -> None:
        """Run one loop; a bug is logged with its trace and the loop started again."""
        while not self._stopping.is_set():
            try:
                await body()
                return
            except asyncio.CancelledError:
                raise
            except TRANSIENT as exc:
                log.warning("%s loop: Redis unavailable: %s", name, exc)
            except Exception:
                log.exception("%s loop failed; restarting it", name)
            await self._sleep(1.0)

    async def _sleep(self, seconds: float) -> None:
        """Sleep with jitter, returning early when the worker stops."""
        delay = seconds * (1 + self._rng.uniform(-JITTER, JITTER))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    # -- capacity -------------------------------------------------------------------------------

    async def _reserve(self, most: int) -> int:
        """Wait for free capacity and take up to ``most`` slots (0 when stopping)."""
        while self._free <= 0:
            if self._stopping.is_set():
                return 0
            self._free_changed.clear()
            stop = asyncio.ensure_future(self._stopping.wait())
            free = asyncio.ensure_future(self._free_changed.wait())
            try:
                await asyncio.wait({stop, free}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                free.cancel()
        if self._stopping.is_set():
            return 0
        n = min(self._free, most)
        self._free -= n
        return n

    def _take(self, most: int) -> int:
        n = max(0, min(self._free, most))
        self._free -= n
        return n

    def _release(self, n: int = 1) -> None:
        if n > 0:
            self._free += n
            self._free_changed.set()

    # -- poll -----------------------------------------------------------------------------------

    async def _active_streams(self) -> list[str]:
        """Streams of the queues not paused, p9 first across all queues."""
        now = asyncio.get_running_loop().time()
        if now - self._paused_at >= PAUSE_REFRESH_S:
            flags = await self.redis.mget([keys.queue_paused(q) for q in self.queues])
            paused = {q for q, f in zip(self.queues, flags, strict=True) if f == "1"}
            if paused != self._paused:
                log.info("worker %s: paused queues now %s", self.worker_id, sorted(paused) or "-")
            self._paused = paused
            self._paused_at = now
        served = [q for q in self.queues if q not in self._paused]
        return [keys.stream(q, p) for p in keys.PRIORITIES for q in served]

    async def _poll_loop(self) -> None:
        """Read, start, repeat; block when there is nothing to read.

        Race-free wake-up: before the read that may end in a block, the group's last-delivered
        id of each stream is sampled; the block (XREAD from those ids, consuming nothing) returns
        at once for any entry added after the sample, so an entry that lands on a stream just
        after the scan passed it still wakes the worker.
        """
        idle = False
        while not self._stopping.is_set():
            streams = await self._active_streams()
            if not streams:
                await self._sleep(PAUSE_REFRESH_S)
                continue
            n = await self._reserve(READ_BATCH)
            if n == 0:
                return
            try:
                since = await self._last_delivered(streams) if idle else None
                entries = await self._read(streams, n)
            except BaseException:
                self._release(n)
                raise
            self._release(n - len(entries))
            if entries:
                idle = False
                await asyncio.shield(self._start(entries))  # read entries are always started
            elif since is None:
                idle = True  # sample, read once more, then block
            else:
                await self.redis.xread(
                    {s: since.get(s, "$") for s in streams}, count=1, block=BLOCK_MS
                )

    async def _last_delivered(self, streams: Sequence[str]) -> dict[str, str]:
        """The consumer group's last-delivered id of each stream (one pipeline)."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        out: dict[str, str] = {}
        for stream, groups in zip(streams, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(groups, Exception):
                continue  # no stream yet: "$" (its first entry creates it)
            for g in groups:
                if g.get("name") == keys.CONSUMER_GROUP:
                    out[stream] = str(g["last-delivered-id"])
        return out

    async def _read(self, streams: Sequence[str], capacity: int) -> list[Entry]:
        """Strict priority: each stream in order, only while capacity is left."""
        got: list[Entry] = []
        for stream in streams:
            left = capacity - len(got)
            if left <= 0:
                break
            try:
                reply = await self.redis.xreadgroup(
                    keys.CONSUMER_GROUP, self.worker_id, {stream: ">"}, count=left
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.store.ensure_groups(keys.stream_queue(stream)[0])
                continue
            entries, bad = parse_read(cast(list[Any], reply))
            got.extend(entries)
            if bad:
                await self._drop_unusable(bad)
        return got

    async def _drop_unusable(self, bad: Sequence[tuple[str, str]]) -> None:
        """Entries without a task id cannot belong to any task: ACK + XDEL, and say so."""
        pipe = self.redis.pipeline(transaction=False)
        for stream, entry_id in bad:
            log.error(
                "stream %s entry %s has no task fields: acknowledged and deleted", stream, entry_id
            )
            pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
        await pipe.execute()

    # -- start ----------------------------------------------------------------------------------

    async def _start(self, entries: Sequence[Entry]) -> None:
        """One pipeline of start scripts for a read batch; each slot is already reserved."""
        todo = []
        for entry in entries:
            if entry.entry_id in self.inflight:  # reclaimed from ourselves: it is running here
                self._release()
            else:
                todo.append(entry)
        if not todo:
            return
        calls = [start_call(e, self.worker_id, self.settings) for e in todo]
        try:
            replies = await self.scripts.call_many(self.redis, calls)
        except BaseException:
            self._release(len(todo))  # entries stay pending: the reaper redelivers them
            raise
        for entry, reply in zip(todo, replies, strict=True):
            if isinstance(reply, Exception):
                log.error(
                    "start of task %s (entry %s) failed: %s", entry.task_id, entry.entry_id, reply
                )
                self._release()
                continue
            start = StartReply.parse(reply)
            if start.kind != "run":
                self._skipped(entry, start)
                self._release()
                continue
            self._launch(entry, start)

    def _skipped(self, entry: Entry, start: StartReply) -> None:
        level = logging.WARNING if start.kind in {"duplicate", "dead"} else logging.INFO
        log.log(
            level,
            "task %s (entry %s of %s) not run: %s %s",
            entry.task_id,
            entry.entry_id,
            entry.stream,
            start.kind,
            start.detail,
            extra={"task_id": entry.task_id, "task_type": entry.task_type, "queue": entry.queue},
        )
        if start.kind == "dead":
            self.tasks_failed += 1
        for obs in self.observers:
            obs.task_skipped(entry, start)

    def _launch(self, entry: Entry, start: StartReply) -> None:
        ex = Execution(entry, start, on_release=self._release)
        self.inflight[entry.entry_id] = ex
        for obs in self.observers:
            obs.task_started(entry, start)
        task = asyncio.create_task(self._execute(ex), name=f"task-{entry.task_id}")
        self._executions.add(task)
        task.add_done_callback(self._executions.discard)

    async def _execute(self, ex: Execution) -> None:
        assert self._threads is not None
        entry = ex.entry
        # This coroutine runs as its own asyncio task: the fields end with it.
        bind_log_fields(
            task_id=entry.task_id, task_type=entry.task_type, queue=entry.queue, attempt=ex.attempt
        )
        try:
            outcome = await run_handler(
                ex,
                self.handlers.get(entry.task_type),
                self.worker_id,
                self.settings,
                self._threads,
                self._rng,
            )
            if outcome is None:
                log.info(
                    "task %s attempt %d stopped (%s): left for another worker",
                    entry.task_id,
                    ex.attempt,
                    ex.cancel_reason,
                )
                return
            ex.finishing = True
            call = finish_call(entry, ex.attempt, outcome, self.worker_id, self.settings)
            reply = await asyncio.shield(self._finisher.submit(call))
            status = self._finished(ex, outcome.kind, reply)
            for obs in self.observers:
                obs.task_finished(ex, status, outcome.duration_ms, outcome)
        finally:
            self.inflight.pop(entry.entry_id, None)
            ex.drop_hold("execution")

    def _finished(self, ex: Execution, kind: str, reply: Any) -> str:
        entry = ex.entry
        if isinstance(reply, Exception):
            log.error(
                "finish of task %s attempt %d failed: %s: the entry stays pending",
                entry.task_id,
                ex.attempt,
                reply,
            )
            return "error"
        status = str(reply[0])
        if status == "fenced":
            log.warning(
                "task %s attempt %d: finish fenced (%s): another worker owns it; nothing written",
                entry.task_id,
                ex.attempt,
                reply[1],
            )
            return status
        self.tasks_processed += 1
        if status in {"failed", "dead_lettered"}:
            self.tasks_failed += 1
        elif status == "retrying" and kind == "error":
            self.tasks_failed += 1
            self.tasks_retried += 1
        log.debug("task %s attempt %d: %s", entry.task_id, ex.attempt, status)
        return status

    # -- reaper ---------------------------------------------------------------------------------

    async def _reaper_loop(self) -> None:
        while not self._stopping.is_set():
            await self._sleep(self.settings.reaper_interval_s)
            if self._stopping.is_set():
                return
            await self.reap_once()

    async def reap_once(self) -> int:
        """Claim entries idle past the visibility timeout; returns how many were started."""
        min_idle_ms = round(self.settings.visibility_timeout_s * 1000)
        started = 0
        for stream in await self._active_streams():
            cursor = "0-0"
            while True:
                n = self._take(READ_BATCH)
                if n == 0:
                    return started
                try:
                    reply = await self.redis.xautoclaim(
                        stream, keys.CONSUMER_GROUP, self.worker_id, min_idle_ms, cursor, count=n
                    )
                except ResponseError as exc:
                    self._release(n)
                    if "NOGROUP" not in str(exc):
                        raise
                    await self.store.ensure_groups(keys.stream_queue(stream)[0])
                    break
                except BaseException:
                    self._release(n)
                    raise
                cursor = str(reply[0])
                claimed = cast(list[tuple[str | None, dict[str, str] | None]], reply[1])
                entries, bad, nil = [], [], 0
                for entry_id, fields in claimed:
                    if entry_id is None:
                        nil += 1
                        continue
                    entry = Entry.parse(stream, entry_id, fields)
                    if entry is None:
                        bad.append((stream, entry_id))
                    else:
                        entries.append(entry)
                self._release(n - len(entries))
                if entries:
                    log.warning(
                        "reaper: reclaimed %d entr%s idle over %dms from %s",
                        len(entries),
                        "y" if len(entries) == 1 else "ies",
                        min_idle_ms,
                        stream,
                    )
                    started += len(entries)
                    await asyncio.shield(self._start(entries))
                if bad:
                    await self._drop_unusable(bad)
                if nil:
                    await self._resolve_deleted(stream)
                if len(reply) > 2 and reply[2]:
                    log.error(
                        "reaper: entries deleted from %s while pending (Redis removed "
                        "them from the pending list): %s",
                        stream,
                        ", ".join(reply[2]),
                    )
                if cursor == "0-0":
                    break
        return started

    async def _resolve_deleted(self, stream: str) -> None:
        """Redis 6.2: XAUTOCLAIM answers nil for an entry deleted while pending and leaves it in
        the pending list (now ours). Find such ids among ours that are not in flight, check
        they are gone from the stream, acknowledge them and log each."""
        mine = await self.redis.xpending_range(
            stream, keys.CONSUMER_GROUP, "-", "+", 1000, consumername=self.worker_id
        )
        candidates = [
            str(p["message_id"]) for p in mine if str(p["message_id"]) not in self.inflight
        ]
        if not candidates:
            return
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in candidates:
            pipe.xrange(stream, entry_id, entry_id)
        gone = [i for i, r in zip(candidates, await pipe.execute(), strict=True) if not r]
        if gone:
            await self.redis.xack(stream, keys.CONSUMER_GROUP, *gone)
            log.error(
                "reaper: entries %s of %s were deleted while pending: acknowledged; "
                "their task (if any) cannot be found from the stream",
                ", ".join(gone),
                stream,
            )

    # -- cancellation and lost leases -----------------------------------------------------------

    async def _cancel_loop(self) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_S * (1 + self._rng.uniform(-JITTER, JITTER)))
            await self.check_cancellations()

    async def check_cancellations(self) -> int:
        running = [ex for ex in self.inflight.values() if not ex.finishing and not ex.cancel_reason]
        if not running:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for ex in running:
            pipe.hget(keys.task(ex.entry.task_id), "cancel_requested")
        cancelled = 0
        for ex, flag in zip(running, await pipe.execute(), strict=True):
            if flag == "1" and ex.cancel("user"):
                log.info(
                    "task %s attempt %d: cancel requested, stopping its handler",
                    ex.entry.task_id,
                    ex.attempt,
                )
                cancelled += 1
        return cancelled

    def _on_lost(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            ex = self.inflight.get(entry_id)
            if ex is not None and ex.cancel("lost"):
                log.warning(
                    "task %s attempt %d: lease lost, handler stopped", ex.entry.task_id, ex.attempt
                )

    # -- heartbeat callbacks (called on the heartbeat thread) ------------------------------------

    def _lost_from_thread(self, loop: asyncio.AbstractEventLoop, entry_ids: list[str]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closing: nothing to stop
            loop.call_soon_threadsafe(self._on_lost, entry_ids)

    def _snapshot(self) -> list[tuple[str, str]]:
        return [(ex.entry.stream, ex.entry.entry_id) for ex in list(self.inflight.values())]

    async def _scheduler_ticked(self, result: TickResult) -> None:
        for obs in self.observers:
            await obs.scheduler_ticked(result, self.redis)

    def _stats(self) -> dict[str, Any]:
        return {
            "active_tasks": self.active_tasks,
            "tasks_processed": self.tasks_processed,
            "tasks_failed": self.tasks_failed,
            "tasks_retried": self.tasks_retried,
        }
