"""What happens to an entry once intake has read it: start, run, finish (contract sections 4,
6, 15; DESIGN 3). In this file's order:

1. **start** (:meth:`Executor.start`): the start scripts of a read batch go to Redis in one
   pipeline; an entry that does not run (already terminal, cancelled, expired, a duplicate...)
   gives its slot back at once;
2. **run**: each started entry runs as its own asyncio task, through
   :meth:`Runner.run <dtq.worker.handlers.Runner.run>` (its arguments, the lease check right
   before the handler, the handler under ``timeout_ms``, how it ended as an outcome);
3. **finish**: how it ended goes to :class:`~dtq.worker.finish.Finisher`, which records it
   (the finish script in its next pipeline) and tells it; so does an entry that did not run.

**Capacity** is the worker's free execution slots, all kept here: intake reserves slots before
it reads (:meth:`Executor.reserve`, :meth:`Executor.take`), hands what it read to
:meth:`Executor.start` with the slots it holds, and every slot comes back here, from the part
of a reservation a read did not fill, from an entry that did not run, or when an execution has
ended (and its thread: a sync handler that outlived its timeout keeps its slot until it
returns). Cancel requests (:meth:`Executor.check_cancellations`) and leases the heartbeat found
lost (:meth:`Executor.on_lost`) stop handlers here too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

from dtq import calls, keys
from dtq.calls import Entry, StartReply, entry_key
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.log import bind as bind_log_fields
from dtq.store import Store
from dtq.worker.fair import FairMover
from dtq.worker.finish import Finisher
from dtq.worker.handlers import Execution, Runner
from dtq.worker.limits import LimitCache
from dtq.worker.observer import TaskStarted, WorkerObserver
from dtq.worker.outage import NOT_RUN, TRANSIENT, RedisOutage
from dtq.worker.threads import ThreadRunner
from dtq_tasks import Handler

__all__ = ["Capacity", "Executor", "wait_first"]

log = logging.getLogger("dtq.worker.worker")


class Capacity:
    """The free execution slots of one worker (``size`` = its concurrency).

    An ``urgent`` reservation (the reaper's) is served before every other: while one waits,
    the slots that free up go to it, not to a poll loop.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self._changed = asyncio.Event()
        self._urgent = 0

    @property
    def used(self) -> int:
        return self.size - self.free

    async def reserve(self, most: int, stopping: asyncio.Event, *, urgent: bool = False) -> int:
        """Wait for a free slot, then take up to ``most`` (0 once ``stopping`` is set)."""
        if urgent:
            self._urgent += 1
        try:
            while not stopping.is_set() and (self.free <= 0 or (self._urgent and not urgent)):
                self._changed.clear()
                await wait_first(stopping, self._changed)
        finally:
            if urgent:
                self._urgent -= 1
                if not self._urgent:
                    self._changed.set()  # the poll loops may take what is left
        if stopping.is_set():
            return 0
        return self.take(most)

    def take(self, most: int) -> int:
        """Take up to ``most`` free slots now, without waiting."""
        n = max(0, min(self.free, most))
        self.free -= n
        return n

    def release(self, n: int = 1) -> None:
        if n > 0:
            self.free += n
            self._changed.set()


class Executor:
    """What one worker has in flight (``inflight``: entry id -> execution), its slots and its
    counts; see the module docstring."""

    def __init__(
        self,
        *,
        worker_id: str,
        settings: Settings,
        store: Store,
        handlers: Mapping[str, Handler],
        observers: Sequence[WorkerObserver],
        concurrency: int,
        clock: RedisClock,
        outage: RedisOutage,
        rng: random.Random,
        queues: Sequence[str] = (),
    ) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.store = store  # what the script calls run against
        self.redis = store.redis
        self.handlers = handlers
        self.observers = observers
        self.clock = clock
        self._rng = rng
        self._capacity = Capacity(concurrency)
        self.finisher = Finisher(
            worker_id=worker_id,
            settings=settings,
            store=store,
            observers=observers,
            outage=outage,
        )
        self.limits = LimitCache(store, queues)  # read again every second by the worker
        self.fair = FairMover(store, queues, lambda: self.limits.fair)  # run by the worker
        self.threads = ThreadRunner(concurrency)  # sync handlers: one thread per slot at most
        self.runner = Runner(
            worker_id=worker_id,
            settings=settings,
            store=store,
            handlers=handlers,
            clock=clock,
            threads=self.threads,
            rng=rng,
            queues=queues,
        )
        self.inflight: dict[str, Execution] = {}
        # entry id -> (entry, start token) of a start whose reply was lost (see start())
        self.lost: dict[str, tuple[Entry, str]] = {}
        self._starting: set[str] = set()  # entry ids whose start script is on its way
        self.executions: set[asyncio.Task[None]] = set()

    # -- slots ----------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self._capacity.size

    @property
    def active(self) -> int:
        """Slots taken: reserved by intake or held by an execution."""
        return self._capacity.used

    async def reserve(self, most: int, stopping: asyncio.Event, *, urgent: bool = False) -> int:
        """Wait for a free slot, then take up to ``most`` for entries about to be read (0 once
        ``stopping`` is set). ``urgent`` (the reaper's) goes ahead of every other."""
        return await self._capacity.reserve(most, stopping, urgent=urgent)

    def take(self, most: int) -> int:
        """Take up to ``most`` free slots now, without waiting."""
        return self._capacity.take(most)

    def give_back(self, slots: int) -> None:
        """Slots reserved for a read that failed."""
        self._capacity.release(slots)

    # -- start ----------------------------------------------------------------------------------

    async def start(self, entries: Sequence[Entry], slots: int) -> None:
        """Start what one read returned, in the ``slots`` reserved for it: one pipeline of
        start scripts; the slots not used are given back.

        A lost connection may have lost the replies after Redis ran the scripts: those entries
        may be RUNNING here, neither in flight nor renewed. They are kept in :attr:`lost` with
        the batch's start token, and the next start of one of them (:meth:`lost_entries`, sent
        again by intake once Redis answers, or the reaper's claim) is a resume: start.lua runs
        it at the attempt that start set when it ran, instead of counting a crash redelivery.
        A start a Redis Cluster refused (:data:`~dtq.worker.outage.NOT_RUN`) is kept there
        too, and its error raised once the others are launched."""
        todo = []
        resume: dict[str, str] = {}
        starting = self._starting
        for entry in entries:
            key = entry.key
            if key in self.inflight or key in starting:
                if self.lost:
                    self.lost.pop(key, None)
                continue  # reclaimed from ourselves: running, or being started by another path
            if self.lost:
                was = self.lost.pop(key, None)
                if was is not None:
                    resume[key] = was[1]
            starting.add(key)
            todo.append(entry)
        self._capacity.release(slots - len(todo))
        if not todo:
            return
        token = os.urandom(8).hex()
        try:
            replies = await calls.start_many(
                self.store,
                todo,
                self.worker_id,
                token,
                resume,
                None if self.limits.empty else self.limits.uses,
            )
        except TRANSIENT:
            self._capacity.release(len(todo))
            for entry in todo:
                key = entry.key
                self.lost[key] = (entry, resume.get(key, token))
            raise
        except BaseException:
            self._capacity.release(len(todo))  # entries stay pending: the reaper redelivers them
            raise
        finally:
            for entry in todo:
                starting.discard(entry.key)
        if self.limits.fair:
            for queue in {entry.queue for entry in todo}:
                self.fair.poke(queue)
        refused: Exception | None = None
        for entry, start in zip(todo, replies, strict=True):
            if isinstance(start, NOT_RUN):  # a cluster failover: kept to be started again
                self._capacity.release()
                key = entry.key
                self.lost[key] = (entry, resume.get(key, token))
                refused = start
                continue
            if isinstance(start, Exception):
                log.error(
                    "start of task %s (entry %s) failed: %s", entry.task_id, entry.entry_id, start
                )
                self._capacity.release()
                continue
            if start.kind != "run":
                self._capacity.release()
                self.finisher.skipped(entry, start)
                continue
            self._launch(entry, start)
        if refused is not None:
            raise refused  # Redis unavailable for now: the caller's loop waits and tries again

    def holds(self, stream: str, entry_id: str) -> bool:
        """The entry is in flight, being started, or a start of it lost its reply."""
        key = entry_key(stream, entry_id)
        return key in self.inflight or key in self._starting or key in self.lost

    def lost_entries(self, most: int) -> list[Entry]:
        """Up to ``most`` entries whose start reply was lost (see :meth:`start`)."""
        return [entry for entry, _ in list(self.lost.values())[:most]]

    def _launch(self, entry: Entry, start: StartReply) -> None:
        ex = Execution(entry, start)
        self.inflight[entry.key] = ex
        self.runner.progress.open(ex)
        if self.observers:
            wait_ms = None
            if start.attempt == 1 and start.created_ms is not None:
                wait_ms = start.started_ms - start.created_ms
            event = TaskStarted(
                entry.task_id,
                entry.queue,
                entry.task_type,
                start.attempt,
                wait_ms,
                entry.payload,
                start.throttled_ms,
            )
            for obs in self.observers:
                obs.task_started(event)
        task = asyncio.create_task(self._execute(ex), name=f"task-{entry.task_id}")
        self.executions.add(task)
        task.add_done_callback(self.executions.discard)

    # -- run ------------------------------------------------------------------------------------

    async def _execute(self, ex: Execution) -> None:
        entry = ex.entry
        # This coroutine runs as its own asyncio task: the fields end with it.
        bind_log_fields(
            task_id=entry.task_id, task_type=entry.task_type, queue=entry.queue, attempt=ex.attempt
        )
        try:
            outcome = await self.runner.run(ex)
            reported = self.runner.progress.end(ex, stop=outcome is None)
            if reported is not None and outcome is not None:
                await reported.close()  # before the finish: its last report, none after it
            if outcome is None:
                log.info(
                    "task %s attempt %d stopped (%s): left for another worker",
                    entry.task_id,
                    ex.attempt,
                    ex.cancel_reason,
                )
                return
            ex.finishing = True
            await self.finisher.finish(entry, ex.start, outcome, ex.handler_task is not None)
        except Exception:  # a bug here must not kill the worker; the entry stays pending
            log.exception(
                "task %s attempt %d: execution failed inside the worker; the entry is left "
                "for redelivery",
                entry.task_id,
                ex.attempt,
            )
        finally:
            self.runner.progress.end(ex, stop=True)  # when the above did not get to it
            self.inflight.pop(entry.key, None)
            self._release(ex)

    def _release(self, ex: Execution) -> None:
        """The slot of ``ex`` comes back now, or once the thread of its sync handler returns
        (one that outlived its timeout runs on: Python cannot stop it)."""
        thread = ex.thread
        if thread is None or thread.done():
            self._capacity.release()
        else:
            thread.add_done_callback(self._thread_returned)

    def _thread_returned(self, _thread: asyncio.Future[Any]) -> None:
        self._capacity.release()

    # -- cancellation and lost leases -----------------------------------------------------------

    async def check_cancellations(self) -> int:
        running = [
            ex
            for ex in self.inflight.values()
            if not ex.finishing and not ex.cancel_reason and not ex.cancel_noted
        ]
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
            elif flag == "1" and ex.thread_wait is not None:
                ex.cancel_noted = True
                log.warning(
                    "task %s attempt %d: cancel requested after its sync handler timed out; its "
                    "thread %s: the task is recorded (CANCELLED unless its attempts are used up) "
                    "only once the thread has ended",
                    ex.entry.task_id,
                    ex.attempt,
                    "did not stop when interrupted and still runs"
                    if ex.overdue
                    else "was interrupted and is stopping",
                )
        return cancelled

    def on_lost(self, lost: list[str]) -> None:
        """``lost``: :func:`~dtq.calls.entry_key` of the entries whose lease a touch found gone."""
        for key in lost:
            ex = self.inflight.get(key)
            if ex is not None and ex.cancel("lost"):
                log.warning(
                    "task %s attempt %d: lease lost, %s",
                    ex.entry.task_id,
                    ex.attempt,
                    "handler stopped"
                    if ex.handler_started
                    else "handler not started: not run here",
                )

    def snapshot(self) -> list[tuple[str, str, str]]:
        """(stream, entry id, task id) of every execution in flight (the heartbeat's touch)."""
        return [
            (ex.entry.stream, ex.entry.entry_id, ex.entry.task_id)
            for ex in list(self.inflight.values())
        ]


async def wait_first(
    stopping: asyncio.Event, event: asyncio.Event, seconds: float | None = None
) -> None:
    """Wait until ``event`` or ``stopping`` is set, or ``seconds`` have passed (None: no limit)."""
    waits = {asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(event.wait())}
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
