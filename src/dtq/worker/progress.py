"""``ctx.progress()`` of running handlers, written to Redis at a bounded rate (docs/handlers.md,
"Progress").

One :class:`ProgressReporter` per worker. Every context it gives out carries the same bound
method (:meth:`ProgressReporter.report`); an execution is registered while its handler may
report (:meth:`ProgressReporter.open` .. :meth:`ProgressReporter.end`), so a task that never
reports costs two dict operations and no allocation. A task's first report makes its
:class:`TaskProgress`, which keeps only the latest value and writes (progress.lua, fenced to this
attempt) the first one at once, then at most one every :data:`PROGRESS_INTERVAL_S`: the values
in between are coalesced into one trailing write. ``report`` takes a lock and sets a field; it
schedules work on the event loop (thread-safely: sync handlers report from their thread) only
when no write is due yet, so a handler may call it thousands of times a second.

At the attempt's end the reporter is closed before the finish is sent: a value still waiting
for its turn is written first (the last progress is kept with the terminal state), and nothing
is written after. An attempt stopped without a finish (shutdown, lost lease) drops it. A fenced
reply (the attempt is no longer this worker's running one) stops the task's reporter.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING

from dtq import calls
from dtq.store import Store
from dtq.worker.outage import TRANSIENT
from dtq_tasks import TaskContext

if TYPE_CHECKING:
    from dtq.worker.handlers import Execution

__all__ = ["PROGRESS_INTERVAL_S", "TRAILING_WRITE_S", "ProgressReporter", "TaskProgress"]

log = logging.getLogger("dtq.worker.worker")

PROGRESS_INTERVAL_S = 0.25
"""The least time between two progress writes of one task."""

TRAILING_WRITE_S = 2.0
"""How long the end of an attempt waits for its last progress write before the finish."""


class ProgressReporter:
    """The progress of every execution of one worker; see the module docstring."""

    def __init__(self, store: Store, worker_id: str) -> None:
        self._store = store
        self._worker_id = worker_id
        # task id -> its execution while it may report, or the reporter its first report made
        self._open: dict[str, Execution | TaskProgress] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self.report = self._report  # one bound method, given to every context

    def open(self, ex: Execution) -> None:
        """``ex``'s handler is about to run (called on the worker's event loop): its reports
        count from now."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        self._open[ex.entry.task_id] = ex

    def end(self, ex: Execution, *, stop: bool = False) -> TaskProgress | None:
        """``ex``'s handler has ended: its reports count no more. Returns its
        :class:`TaskProgress` when it reported, to :meth:`TaskProgress.close` before the
        finish (with ``stop``, stopped here: no finish follows), else None."""
        if self._open.get(ex.entry.task_id) is None:
            return None  # ended already (a report only replaces a registered execution)
        held = self._take(ex)
        if held is not None and stop:
            held.stop()
        return held

    def _take(self, ex: Execution) -> TaskProgress | None:
        with self._lock:
            held = self._open.get(ex.entry.task_id)
            if held is ex:
                del self._open[ex.entry.task_id]
            elif isinstance(held, TaskProgress) and held.ex is ex:
                del self._open[ex.entry.task_id]
                return held
        return None

    def _report(self, ctx: TaskContext, fraction: float | None, data_json: str) -> None:
        held = self._open.get(ctx.task_id)
        if held is None:
            return
        if not isinstance(held, TaskProgress):
            if held.attempt != ctx.attempt:
                return  # a context of an earlier attempt (a thread that outlived it)
            with self._lock:
                if self._open.get(ctx.task_id) is not held:
                    return  # closed meanwhile
                assert self._loop is not None  # set by open()
                reporter = TaskProgress(
                    held, self._store, self._worker_id, self._loop, self._loop_thread
                )
                self._open[ctx.task_id] = reporter
            held = reporter
        elif held.ex.attempt != ctx.attempt:
            return
        held.offer(fraction, data_json)


class TaskProgress:
    """One execution's progress: the latest value and at most one write at a time."""

    __slots__ = (
        "_due",
        "_latest",
        "_lock",
        "_loop",
        "_loop_thread",
        "_store",
        "_timer",
        "_worker_id",
        "_writing",
        "closed",
        "ex",
        "fenced",
        "scheduled",
    )

    def __init__(
        self,
        ex: Execution,
        store: Store,
        worker_id: str,
        loop: asyncio.AbstractEventLoop,
        loop_thread: int,
    ) -> None:
        self.ex = ex
        self._store = store
        self._worker_id = worker_id
        self._loop = loop
        self._loop_thread = loop_thread
        self._lock = threading.Lock()
        self._latest: tuple[float | None, str] | None = None
        self.scheduled = False  # a write is due or under way: later values just wait
        self.closed = False
        self.fenced = False  # a write was refused: this attempt is not this worker's any more
        self._due = 0.0  # monotonic time before which no write starts
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task[None] | None = None

    def offer(self, fraction: float | None, data_json: str) -> None:
        """Keep the latest value; schedule a write only when none is scheduled."""
        with self._lock:
            if self.closed:
                return
            self._latest = (fraction, data_json)
            if self.scheduled:
                return
            self.scheduled = True
        if threading.get_ident() == self._loop_thread:
            self._schedule()
            return
        try:
            self._loop.call_soon_threadsafe(self._schedule)
        except RuntimeError:  # the loop has closed (a thread that outlived its worker)
            self.closed = True

    def _schedule(self) -> None:
        """On the loop: write now, or when the interval since the last write has passed."""
        if self.closed:
            return
        delay = self._due - time.monotonic()
        if delay > 0:
            self._timer = self._loop.call_later(delay, self._start_write)
        else:
            self._start_write()

    def _start_write(self) -> None:
        self._timer = None
        if not self.closed:
            self._writing = self._loop.create_task(self._write())

    async def _write(self) -> None:
        with self._lock:
            value, self._latest = self._latest, None
        if value is not None:
            self._due = time.monotonic() + PROGRESS_INTERVAL_S
            await self._send(*value)
        with self._lock:
            self._writing = None
            if self._latest is None or self.closed:
                self.scheduled = False
                return
        self._schedule()  # values came meanwhile: one trailing write, after the interval

    async def _send(self, fraction: float | None, data_json: str) -> None:
        ex = self.ex
        try:
            reply = await calls.progress(
                self._store, ex.entry, ex.attempt, self._worker_id, fraction, data_json
            )
        except TRANSIENT as exc:
            log.debug("task %s: progress not written: %s", ex.entry.task_id, exc)
            return
        except Exception:  # a bug must not end the handler's execution
            log.exception("task %s: progress write failed", ex.entry.task_id)
            return
        if not reply.written:
            log.info(
                "task %s attempt %d: progress not written (%s): no longer this worker's "
                "running attempt; later reports are dropped",
                ex.entry.task_id,
                ex.attempt,
                reply.detail,
            )
            with self._lock:
                self.closed = self.fenced = True
                self._latest = None

    def stop(self) -> tuple[float | None, str] | None:
        """No new write from now (one under way goes on); returns the value still waiting."""
        with self._lock:
            self.closed = True
            value, self._latest = self._latest, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return value

    async def close(self) -> None:
        """The attempt's finish follows: the value still waiting is written, after a write
        under way (:data:`TRAILING_WRITE_S` at most); nothing is written after this returns."""
        value = self.stop()
        writing = self._writing
        try:
            async with asyncio.timeout(TRAILING_WRITE_S):
                if writing is not None:
                    await asyncio.shield(writing)
                if value is not None and not self.fenced:
                    await self._send(*value)
        except TimeoutError:
            log.debug("task %s: the last progress write took too long", self.ex.entry.task_id)
        finally:
            if writing is not None and not writing.done():
                writing.cancel()  # past the wait: it must not land after the finish
