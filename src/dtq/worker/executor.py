"""Running one handler and recording how it ended (contract sections 4, 6, 15; DESIGN 3).

- :class:`ThreadRunner`: sync handlers run on daemon threads (GIL-bound; CPU-heavy work wants
  several processes). A thread that timed out or was cancelled runs on: Python cannot stop it,
  so its slot stays taken until it returns and concurrency stays bounded.
- :func:`run_handler`: payload decode and validation, the handler under ``timeout_ms``, then
  classification (:mod:`dtq.retry`) into an :class:`~dtq.calls.Outcome`.
- :class:`Finisher`: finish scripts go to Redis in one pipeline per event-loop tick, never one
  awaited call per task; a lost connection is retried, since the script is fenced and atomic.
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dtq import calls
from dtq.calls import Entry, FinishReply, Outcome, StartReply
from dtq.config import Settings
from dtq.models import compact_json
from dtq.retry import PayloadDecodeError, classify, next_retry_delay_s, sanitize
from dtq.scripts import Call
from dtq.store import Store, ms_to_dt
from dtq.worker.outage import TRANSIENT, RedisOutage
from dtq_tasks import Handler, RescheduleError, TaskContext

__all__ = ["Execution", "Finisher", "LeaseLostError", "ThreadRunner", "run_handler"]

log = logging.getLogger(__name__)

FINISH_BATCH_MAX = 512


class LeaseLostError(Exception):
    """The entry's lease was taken over before its handler started: it must not run here."""


@dataclass(eq=False)
class Execution:
    """One started entry, from its start reply until its finish reply.

    ``cancel_reason``: ``user`` (a cancel request: finished CANCELLED), ``shutdown`` (the drain
    timeout passed) or ``lost`` (another worker holds the entry): the last two write nothing
    and leave the entry pending for a peer. The slot is given back when both the execution
    and its thread (if any) are done.
    """

    entry: Entry
    start: StartReply
    handler_task: asyncio.Task[Any] | None = None
    cancel_reason: str | None = None
    finishing: bool = False
    handler_started: bool = False  # the lease check passed and the handler was called
    holds: set[str] = field(default_factory=lambda: {"execution"})
    on_release: Callable[[], None] | None = None
    # Awaited right before the handler is called; False: the lease is gone, do not run it.
    lease_check: Callable[[Execution], Awaitable[bool]] | None = None

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

    def drop_hold(self, name: str) -> None:
        if name in self.holds:
            self.holds.discard(name)
            if not self.holds and self.on_release is not None:
                self.on_release()


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


def _timeout_s(start: StartReply, entry: Entry, settings: Settings) -> float:
    ms = start.timeout_ms or entry.timeout_ms or settings.task_timeout_ms
    return ms / 1000


async def _call_handler(
    handler: Handler,
    payload: dict[str, Any],
    ctx: TaskContext,
    timeout_s: float,
    ex: Execution,
    threads: ThreadRunner,
) -> Any:
    # Nothing is awaited between a passed check and the handler's first line (a failed or
    # slow check is the only await), so a pause of the process cannot fall in between.
    if ex.lease_check is not None and not await ex.lease_check(ex):
        raise LeaseLostError
    ex.handler_started = True
    if handler.is_async:
        async with asyncio.timeout(timeout_s):
            return await handler.fn(payload, ctx)
    fut = threads.submit(handler.fn, payload, ctx)
    ex.holds.add("thread")

    def thread_done(f: asyncio.Future[Any]) -> None:
        if not f.cancelled():
            f.exception()  # retrieved: a result nobody waits for any more is discarded
        ex.drop_hold("thread")

    fut.add_done_callback(thread_done)
    async with asyncio.timeout(timeout_s):
        return await asyncio.shield(fut)


async def run_handler(
    ex: Execution,
    handler: Handler | None,
    worker_id: str,
    settings: Settings,
    threads: ThreadRunner,
    rng: random.Random,
) -> Outcome | None:
    """Execute one started entry; None when it was stopped for shutdown or a lost lease."""
    entry, start = ex.entry, ex.start
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
        return _failure(PayloadDecodeError(f"payload is not JSON: {exc}"), start, settings, rng)
    except Exception as exc:  # pydantic ValidationError, PayloadDecodeError: permanent
        return _failure(exc, start, settings, rng)

    timeout_s = _timeout_s(start, entry, settings)
    ctx = TaskContext(
        task_id=entry.task_id,
        idempotency_key=entry.idempotency_key or None,
        attempt=start.attempt,
        worker_id=worker_id,
        queue=entry.queue,
        deadline=ms_to_dt(start.started_ms + round(timeout_s * 1000)),
        expires_at=_dt(start.expires_at_ms),
        task_type=entry.task_type,
        max_attempts=start.max_attempts,
    )
    t0 = time.monotonic()
    ex.handler_task = asyncio.create_task(
        _call_handler(handler, payload, ctx, timeout_s, ex, threads)
    )
    if ex.cancel_reason is not None:  # cancelled before the handler got going
        ex.handler_task.cancel()
    try:
        result = await ex.handler_task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if ex.cancel_reason == "user":
            return Outcome("cancelled", duration_ms=_ms_since(t0))
        if ex.cancel_reason is not None:
            return None
        if current is not None and current.cancelling():
            raise
        # The handler cancelled itself: an error like any other (permanent).
        return _failure(asyncio.CancelledError("handler was cancelled"), start, settings, rng, t0)
    except LeaseLostError:
        ex.cancel_reason = "lost"
        return None
    except RescheduleError as exc:
        extend = exc.extend_expiration_seconds
        return Outcome(
            "reschedule",
            duration_ms=_ms_since(t0),
            delay_ms=round(exc.delay_seconds * 1000),
            extend_ms=None if extend is None else round(extend * 1000),
        )
    except Exception as exc:
        return _failure(exc, start, settings, rng, t0)
    duration_ms = _ms_since(t0)
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


def _failure(
    exc: BaseException,
    start: StartReply,
    settings: Settings,
    rng: random.Random,
    t0: float | None = None,
) -> Outcome:
    retryable, error_class, message = classify(exc)
    if isinstance(exc, TimeoutError) and not str(exc):
        message = f"handler exceeded timeout_ms={start.timeout_ms}"
    delay_ms = 0
    if retryable and start.attempt < start.max_attempts:
        delay_ms = round(next_retry_delay_s(start.attempt, settings, rng) * 1000)
    return Outcome(
        "error",
        duration_ms=0 if t0 is None else _ms_since(t0),
        error_class=error_class,
        error_message=message,
        retryable=retryable,
        delay_ms=delay_ms,
    )


def _ms_since(t0: float) -> int:
    return round((time.monotonic() - t0) * 1000)


def _dt(ms: int | None) -> datetime | None:
    return None if ms is None else ms_to_dt(ms)


class Finisher:
    """Batches finish calls: everything submitted in one event-loop tick goes in one pipeline.

    A connection failure is retried with backoff for up to ``retry_budget_s`` (the scripts are
    fenced and atomic, so a repeat cannot apply twice); after that each call's future gets the
    error, and the entry stays pending for the reaper of some worker. The failures go to the
    process's :class:`~dtq.worker.outage.RedisOutage`; a batch given up is one line, with its
    task ids.
    """

    def __init__(
        self, store: Store, retry_budget_s: float, outage: RedisOutage | None = None
    ) -> None:
        self._store = store
        self._retry_budget_s = retry_budget_s
        self._outage = outage or RedisOutage()
        self._items: list[tuple[Call, str, asyncio.Future[FinishReply | Exception]]] = []
        self._wake = asyncio.Event()
        self._closing = False

    def submit(self, call: Call, task_id: str) -> asyncio.Future[FinishReply | Exception]:
        """Queue one :func:`dtq.calls.finish_call` call (of task ``task_id``) for the next
        batch; the future gets its reply or its error."""
        fut: asyncio.Future[FinishReply | Exception] = asyncio.get_running_loop().create_future()
        self._items.append((call, task_id, fut))
        self._wake.set()
        return fut

    def close(self) -> None:
        """Flush what is queued, then let :meth:`run` return."""
        self._closing = True
        self._wake.set()

    async def run(self) -> None:
        while True:
            if not self._items:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(0)  # completions of this tick join the batch
            batch = self._items[:FINISH_BATCH_MAX]
            del self._items[:FINISH_BATCH_MAX]
            replies = await self._send([c for c, _, _ in batch], [t for _, t, _ in batch])
            for (_, _, fut), reply in zip(batch, replies, strict=True):
                if not fut.done():
                    fut.set_result(reply)

    async def _send(
        self, batch: Sequence[Call], task_ids: Sequence[str]
    ) -> list[FinishReply | Exception]:
        started = time.monotonic()
        deadline = started + self._retry_budget_s
        delay_s = 0.05
        while True:
            try:
                replies = await calls.finish_many(self._store, batch)
            except TRANSIENT as exc:
                self._outage.failed("finish", exc)
                if time.monotonic() + delay_s > deadline:
                    # Told, with the ids, in the outage reporter's next line (one a second).
                    self._outage.unrecorded(list(task_ids))
                    return [exc] * len(batch)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 2.0)
            except Exception as exc:  # a bug: every caller gets it, the loop goes on
                log.exception("finish pipeline failed")
                return [exc] * len(batch)
            else:
                self._outage.ok("finish")
                return replies
