"""The threads of sync handlers: a small pool of daemon threads bridged to asyncio futures, whose
jobs can be interrupted (an asynchronous exception raised in the thread, at its next Python
bytecode: ``PyThreadState_SetAsyncExc``, CPython). :mod:`dtq.worker.handlers` runs a sync
handler here and interrupts it at its deadline or on a cancel."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ThreadJob", "ThreadRunner"]


_QUEUED, _RUNNING, _DONE = 0, 1, 2


class ThreadJob:
    """One call on a :class:`ThreadRunner` thread: ``future`` gets its result (on the event
    loop its submit was called on); :meth:`ThreadRunner.interrupt` stops it."""

    __slots__ = ("_args", "_call", "_ident", "_sent", "_state", "future", "interrupted_by")

    def __init__(
        self, future: asyncio.Future[Any], call: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        self.future = future
        self._call = call
        self._args = args
        self._state = _QUEUED
        self._ident = 0
        self._sent = False  # an asynchronous exception was set in its thread
        self.interrupted_by: type[BaseException] | None = None


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> int:
    """Raise ``exc`` in thread ``ident`` at its next bytecode (None: withdraw one that has not
    been raised yet); returns how many threads it reached."""
    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    n = int(set_exc(ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc)))
    if n > 1:  # never for a live thread id; withdrawn, as the C API asks
        set_exc(ctypes.c_ulong(ident), None)
        return 0
    return n


class ThreadRunner:
    """A small pool of daemon threads bridged to asyncio futures (at most ``size`` threads).
    Each result goes back to the event loop its :meth:`submit` was called on.

    :meth:`interrupt` raises an exception in the thread of a job that runs, once per job, and
    only while it runs: the lock that guards it also marks the job's start and end, and a
    thread withdraws at the job's end an exception not raised yet, so none can reach the pool's
    own code or the thread's next job."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._queue: queue.SimpleQueue[ThreadJob | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._busy = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> ThreadJob:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._busy += 1
            if self._busy > len(self._threads) and len(self._threads) < self._size:
                t = threading.Thread(
                    target=self._work, name=f"dtq-handler-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
        # The handler sees the context of its execution (log fields bound by the worker).
        job = ThreadJob(fut, contextvars.copy_context().run, (fn, *args))
        self._queue.put(job)
        return job

    def interrupt(self, job: ThreadJob, exc: type[BaseException]) -> bool:
        """Raise ``exc`` in ``job``'s thread (a job not started yet never runs: it ends with
        ``exc``). False when it has ended or was interrupted already."""
        with self._lock:
            if job._state == _DONE or job.interrupted_by is not None:
                return False
            job.interrupted_by = exc
            if job._state == _RUNNING:
                job._sent = _set_async_exc(job._ident, exc) == 1
            return True

    def _work(self) -> None:
        lock = self._lock
        ident = threading.get_ident()
        while True:
            job = self._queue.get()
            if job is None:
                return
            result: Any = None
            error: BaseException | None = None
            try:
                try:
                    with lock:  # the job starts: from now on interrupt() raises in this thread
                        if job.interrupted_by is not None:
                            raise job.interrupted_by()
                        job._ident = ident
                        job._state = _RUNNING
                    result = job._call(*job._args)
                finally:
                    # Inside the outer try: an interrupt raised here (or just before) is the
                    # job's one interrupt, caught below as its end. Once the job is marked
                    # ended under the lock none can be sent, and one sent but not raised yet
                    # is withdrawn: nothing is left for the pool's code or the next job.
                    with lock:
                        job._state = _DONE
                        if job._sent:
                            _set_async_exc(ident, None)
            except BaseException as exc:  # handed to the event loop, like run_in_executor
                error = exc
            self._deliver(job.future, result, error)
            with lock:
                self._busy -= 1

    def _deliver(self, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        def settle() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        # RuntimeError: the loop has closed, the worker is gone and nobody waits for this.
        with contextlib.suppress(RuntimeError):
            fut.get_loop().call_soon_threadsafe(settle)

    def shutdown(self) -> None:
        """Let idle threads end; busy ones are daemons and end with the process."""
        for _ in self._threads:
            self._queue.put(None)
