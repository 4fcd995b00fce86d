"""What happens to an entry once intake has read it: start, run, finish (contract sections 4,
6, 15; DESIGN 3). In this file's order:

1. **start** (:meth:`Executor.start`): the start scripts of a read batch go to Redis in one
   pipeline; an entry that does not run (already terminal, cancelled, expired, a duplicate...)
   gives its slot back at once;
2. **run**: each started entry runs as its own asyncio task. The handler's arguments come from
   :func:`dtq.worker.handlers.prepare`; right before the handler is called the lease is
   checked (:meth:`Executor._lease_held`); the handler runs under ``timeout_ms`` (a sync one
   on a thread of :class:`~dtq.worker.handlers.ThreadRunner`); how it ended becomes an
   outcome;
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
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from dtq import calls, keys
from dtq.calls import Entry, Outcome, StartReply
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.log import bind as bind_log_fields
from dtq.store import Store
from dtq.worker import handlers
from dtq.worker.finish import Finisher
from dtq.worker.handlers import Prepared, ThreadRunner
from dtq.worker.observer import TaskStarted, WorkerObserver
from dtq.worker.outage import TRANSIENT, RedisOutage
from dtq_tasks import Handler, RescheduleError

__all__ = ["Capacity", "Execution", "Executor", "wait_first"]

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


@dataclass(eq=False)
class Execution:
    """One started entry, from its start reply until its finish reply.

    ``cancel_reason``: ``user`` (a cancel request: finished CANCELLED), ``shutdown`` (the drain
    timeout passed) or ``lost`` (another worker holds the entry): the last two write nothing
    and leave the entry pending for a peer. ``holds``: how many of the execution and (a sync
    handler) its thread are still going; the slot is given back when both are done.
    """

    entry: Entry
    start: StartReply
    handler_task: asyncio.Task[Any] | None = None
    cancel_reason: str | None = None
    finishing: bool = False
    handler_started: bool = False  # the lease check passed and the handler was called
    holds: int = 1  # the execution itself

    @property
    def attempt(self) -> int:
        return self.start.attempt

    def cancel(self, reason: str) -> bool:
        """Stop the handler (not the bookkeeping); False when it is past that point."""
        if self.finishing or self.cancel_reason is not None:
            return False
        if self.handler_task is not None and self.handler_task.done():
            return False  # the handler has ended: its outcome is about to be recorded
        self.cancel_reason = reason
        if self.handler_task is not None:
            self.handler_task.cancel()
        return True


class LeaseLostError(Exception):
    """The entry's lease was taken over before its handler started: it must not run here."""


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
        self.threads = ThreadRunner(concurrency)  # sync handlers: one thread per slot at most
        self.inflight: dict[str, Execution] = {}
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
        start scripts; the slots not used are given back."""
        todo = []
        for entry in entries:
            if entry.entry_id not in self.inflight:  # else reclaimed from ourselves: running
                todo.append(entry)
        self._capacity.release(slots - len(todo))
        if not todo:
            return
        try:
            replies = await calls.start_many(self.store, todo, self.worker_id)
        except BaseException:
            self._capacity.release(len(todo))  # entries stay pending: the reaper redelivers them
            raise
        for entry, start in zip(todo, replies, strict=True):
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

    def _launch(self, entry: Entry, start: StartReply) -> None:
        ex = Execution(entry, start)
        self.inflight[entry.entry_id] = ex
        if self.observers:
            wait_ms = None
            if start.attempt == 1 and start.created_ms is not None:
                wait_ms = start.started_ms - start.created_ms
            event = TaskStarted(
                entry.task_id, entry.queue, entry.task_type, start.attempt, wait_ms, entry.payload
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
            outcome = await self._run(ex)
            if outcome is None:
                log.info(
                    "task %s attempt %d stopped (%s): left for another worker",
                    entry.task_id,
                    ex.attempt,
                    ex.cancel_reason,
                )
                return
            ex.finishing = True
            reply = await asyncio.shield(self.finisher.submit(entry, ex.start, outcome))
            self.finisher.recorded(entry, ex.start, outcome, ex.handler_task is not None, reply)
        except Exception:  # a bug here must not kill the worker; the entry stays pending
            log.exception(
                "task %s attempt %d: execution failed inside the worker; the entry is left "
                "for redelivery",
                entry.task_id,
                ex.attempt,
            )
        finally:
            self.inflight.pop(entry.entry_id, None)
            self._drop(ex)

    async def _run(self, ex: Execution) -> Outcome | None:
        """Run one started entry's handler; None when it was stopped for shutdown or a lost
        lease (nothing is recorded: the entry stays pending for a peer)."""
        entry, start, settings = ex.entry, ex.start, self.settings
        call = handlers.prepare(
            entry, start, self.handlers.get(entry.task_type), self.worker_id, settings, self._rng
        )
        if isinstance(call, Outcome):
            return call
        t0 = time.monotonic()
        ex.handler_task = asyncio.create_task(self._call(ex, call))
        if ex.cancel_reason is not None:  # cancelled before the handler got going
            ex.handler_task.cancel()
        try:
            result = await ex.handler_task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if ex.cancel_reason == "user":
                return Outcome("cancelled", duration_ms=handlers.ms_since(t0))
            if ex.cancel_reason is not None:
                return None
            if current is not None and current.cancelling():
                raise
            # The handler cancelled itself: an error like any other (permanent).
            error = asyncio.CancelledError("handler was cancelled")
            return handlers.failed(error, start, settings, self._rng, t0)
        except LeaseLostError:
            ex.cancel_reason = "lost"
            return None
        except RescheduleError as exc:
            return handlers.rescheduled(exc, t0)
        except Exception as exc:
            return handlers.failed(exc, start, settings, self._rng, t0)
        return handlers.succeeded(result, t0, settings)

    async def _call(self, ex: Execution, call: Prepared) -> Any:
        """The handler task: the lease check, then the handler under its timeout. Nothing is
        awaited between a passed check and the handler's first line (a failed or slow check
        is the only await), so a pause of the process cannot fall in between."""
        if not await self._lease_held(ex):
            raise LeaseLostError
        ex.handler_started = True
        handler = call.handler
        if handler.is_async:
            async with asyncio.timeout(call.timeout_s):
                return await handler.fn(call.payload, call.ctx)
        fut = self.threads.submit(handler.fn, call.payload, call.ctx)
        ex.holds += 1  # the thread, dropped when it returns
        fut.add_done_callback(partial(self._thread_done, ex))
        async with asyncio.timeout(call.timeout_s):
            return await asyncio.shield(fut)

    def _thread_done(self, ex: Execution, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: a result nobody waits for any more is discarded
        self._drop(ex)

    def _drop(self, ex: Execution) -> None:
        """One hold of ``ex`` is over (each is dropped once); its slot comes back with the
        last."""
        ex.holds -= 1
        if not ex.holds:
            self._capacity.release()

    async def _lease_held(self, ex: Execution) -> bool:
        """Right before a handler starts: is the lease still this worker's? start.lua renewed
        it at ``started_ms`` (Redis clock), so it is, unless the worker stalled for half the
        visibility timeout since (a stop signal, a VM pause, a starved event loop): then
        touch.lua checks ownership (and renews). A worker that cannot check does not run."""
        age_ms = self.clock.now_ms() - ex.start.started_ms
        if age_ms < self.settings.visibility_timeout_s * 500:
            return True
        entry = ex.entry
        try:
            lost = await calls.touch(self.store, self.worker_id, [(entry.stream, entry.entry_id)])
        except TRANSIENT as exc:
            lost, why = [entry.entry_id], f"Redis unavailable: {exc}"
        else:
            why = "another worker holds it"
        if ex.cancel_reason is not None:
            return False  # stopped meanwhile (the heartbeat saw the lease lost): said there
        if lost:
            log.warning(
                "task %s attempt %d: lease lost before its handler started (%s, started %.1fs "
                "ago): not run here",
                entry.task_id,
                ex.attempt,
                why,
                age_ms / 1000,
            )
            return False
        return True

    # -- cancellation and lost leases -----------------------------------------------------------

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

    def on_lost(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            ex = self.inflight.get(entry_id)
            if ex is not None and ex.cancel("lost"):
                log.warning(
                    "task %s attempt %d: lease lost, %s",
                    ex.entry.task_id,
                    ex.attempt,
                    "handler stopped"
                    if ex.handler_started
                    else "handler not started: not run here",
                )

    def snapshot(self) -> list[tuple[str, str]]:
        """(stream, entry id) of every execution in flight (the heartbeat's touch)."""
        return [(ex.entry.stream, ex.entry.entry_id) for ex in list(self.inflight.values())]


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
