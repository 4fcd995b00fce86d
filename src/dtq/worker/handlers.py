"""Running one started entry's handler (contract sections 4, 6, 15): the run step between
:mod:`dtq.worker.execution`'s start and :mod:`dtq.worker.finish`.

:meth:`Runner.run`, in order: the handler's arguments (:func:`prepare`: or the outcome of an
entry that cannot run, task type unknown here, payload not JSON or not valid for the
handler's model); the handler task, which checks the lease right before the handler is called
(:meth:`Runner._lease_held`) and runs it under ``timeout_ms``; then how it ended, as finish.lua
records it (:func:`succeeded`, :func:`rescheduled`, :func:`failed`: an
:class:`~dtq.calls.Outcome`, errors classified by :mod:`dtq.retry`).

Sync handlers run on the daemon threads of a :class:`ThreadRunner` (GIL-bound; CPU-heavy work
wants several processes). A thread that timed out or was cancelled runs on: Python cannot stop
it, so :attr:`Execution.thread` stays pending, and the executor gives the slot back only when
it returns; concurrency stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dtq import calls
from dtq.calls import Entry, Outcome, StartReply
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.models import compact_json
from dtq.retry import PayloadDecodeError, classify, next_retry_delay_s, sanitize
from dtq.store import Store, ms_to_dt
from dtq.worker.outage import TRANSIENT
from dtq_tasks import Handler, RescheduleError, TaskContext

__all__ = [
    "Execution",
    "Prepared",
    "Runner",
    "ThreadRunner",
    "failed",
    "ms_since",
    "prepare",
    "rescheduled",
    "succeeded",
]

log = logging.getLogger("dtq.worker.worker")


@dataclass(eq=False)
class Execution:
    """One started entry, from its start reply until its finish reply.

    ``cancel_reason``: ``user`` (a cancel request: finished CANCELLED), ``shutdown`` (the drain
    timeout passed) or ``lost`` (another worker holds the entry): the last two write nothing
    and leave the entry pending for a peer. ``thread``: a sync handler's, done once it has
    returned.
    """

    entry: Entry
    start: StartReply
    handler_task: asyncio.Task[Any] | None = None
    cancel_reason: str | None = None
    finishing: bool = False
    handler_started: bool = False  # the lease check passed and the handler was called
    thread: asyncio.Future[Any] | None = None

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


class Runner:
    """Runs the handlers of one worker; see the module docstring."""

    def __init__(
        self,
        *,
        worker_id: str,
        settings: Settings,
        store: Store,
        handlers: Mapping[str, Handler],
        clock: RedisClock,
        threads: ThreadRunner,
        rng: random.Random,
    ) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.store = store
        self.handlers = handlers
        self.clock = clock
        self.threads = threads
        self._rng = rng

    async def run(self, ex: Execution) -> Outcome | None:
        """Run one started entry's handler; None when it was stopped for shutdown or a lost
        lease (nothing is recorded: the entry stays pending for a peer)."""
        entry, start, settings = ex.entry, ex.start, self.settings
        call = prepare(
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
                return Outcome("cancelled", duration_ms=ms_since(t0))
            if ex.cancel_reason is not None:
                return None
            if current is not None and current.cancelling():
                raise
            # The handler cancelled itself: an error like any other (permanent).
            error = asyncio.CancelledError("handler was cancelled")
            return failed(error, start, settings, self._rng, t0)
        except LeaseLostError:
            ex.cancel_reason = "lost"
            return None
        except RescheduleError as exc:
            return rescheduled(exc, t0)
        except Exception as exc:
            return failed(exc, start, settings, self._rng, t0)
        return succeeded(result, t0, settings)

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
        ex.thread = fut = self.threads.submit(handler.fn, call.payload, call.ctx)
        fut.add_done_callback(_retrieve)
        async with asyncio.timeout(call.timeout_s):
            return await asyncio.shield(fut)

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
            owned = [(entry.stream, entry.entry_id, entry.task_id)]
            lost = await calls.touch(self.store, self.worker_id, owned)
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


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """A thread's result nobody waits for any more (timed out, cancelled) is discarded."""
    if not fut.cancelled():
        fut.exception()


@dataclass(slots=True)
class Prepared:
    """What one handler call gets: its validated payload, its context, its timeout."""

    handler: Handler
    payload: dict[str, Any]
    ctx: TaskContext
    timeout_s: float


def prepare(
    entry: Entry,
    start: StartReply,
    handler: Handler | None,
    worker_id: str,
    settings: Settings,
    rng: random.Random,
) -> Prepared | Outcome:
    """The call of ``entry``'s handler, or the outcome of an entry that cannot run."""
    if handler is None:
        return Outcome(
            "error",
            error_class="UnknownTaskType",
            error_message=sanitize(f"unknown_task_type:{entry.task_type}"),
        )
    try:
        raw = json.loads(entry.payload)
        if not isinstance(raw, dict):
            raise PayloadDecodeError("payload is not a JSON object")
        payload = handler.validate(raw)
    except json.JSONDecodeError as exc:
        return failed(PayloadDecodeError(f"payload is not JSON: {exc}"), start, settings, rng)
    except Exception as exc:  # pydantic ValidationError, PayloadDecodeError: permanent
        return failed(exc, start, settings, rng)
    timeout_ms = start.timeout_ms or entry.timeout_ms or settings.task_timeout_ms
    ctx = TaskContext(
        task_id=entry.task_id,
        idempotency_key=entry.idempotency_key or None,
        attempt=start.attempt,
        worker_id=worker_id,
        queue=entry.queue,
        deadline=ms_to_dt(start.started_ms + timeout_ms),
        expires_at=None if start.expires_at_ms is None else ms_to_dt(start.expires_at_ms),
        task_type=entry.task_type,
        max_attempts=start.max_attempts,
    )
    return Prepared(handler, payload, ctx, timeout_ms / 1000)


def succeeded(result: Any, t0: float, settings: Settings) -> Outcome:
    """The handler returned ``result``: stored unless larger than ``DTQ_RESULT_MAX_BYTES``;
    a result that is not JSON ends the attempt as an error."""
    duration_ms = ms_since(t0)
    try:
        result_json = compact_json(result)
    except (TypeError, ValueError) as exc:
        return Outcome(
            "error",
            duration_ms=duration_ms,
            error_class="ResultNotSerializable",
            error_message=sanitize(f"handler result is not JSON-serialisable: {exc}"),
        )
    too_large = len(result_json.encode()) > settings.result_max_bytes
    return Outcome(
        "success",
        duration_ms=duration_ms,
        result_json="" if too_large else result_json,
        result_too_large=too_large,
    )


def rescheduled(exc: RescheduleError, t0: float) -> Outcome:
    """The handler asked to run again later (not an attempt's failure)."""
    extend = exc.extend_expiration_seconds
    return Outcome(
        "reschedule",
        duration_ms=ms_since(t0),
        delay_ms=round(exc.delay_seconds * 1000),
        extend_ms=None if extend is None else round(extend * 1000),
    )


def failed(
    exc: BaseException,
    start: StartReply,
    settings: Settings,
    rng: random.Random,
    t0: float | None = None,
) -> Outcome:
    """The run raised ``exc``: retryable or not (:func:`dtq.retry.classify`), with the delay of
    its retry when attempts are left."""
    retryable, error_class, message = classify(exc)
    if isinstance(exc, TimeoutError) and not str(exc):
        message = f"handler exceeded timeout_ms={start.timeout_ms}"
    delay_ms = 0
    if retryable and start.attempt < start.max_attempts:
        delay_ms = round(next_retry_delay_s(start.attempt, settings, rng) * 1000)
    return Outcome(
        "error",
        duration_ms=0 if t0 is None else ms_since(t0),
        error_class=error_class,
        error_message=message,
        retryable=retryable,
        delay_ms=delay_ms,
    )


def ms_since(t0: float) -> int:
    return round((time.monotonic() - t0) * 1000)


_Job = tuple[asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]]


class ThreadRunner:
    """A small pool of daemon threads bridged to asyncio futures (at most ``size`` threads).
    Each result goes back to the event loop its :meth:`submit` was called on."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._busy = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
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
        self._queue.put((fut, contextvars.copy_context().run, (fn, *args)))
        return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the event loop, like run_in_executor
                self._deliver(fut, None, exc)
            else:
                self._deliver(fut, result, None)
            finally:
                with self._lock:
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
