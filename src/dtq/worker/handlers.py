"""Calling user code (contract sections 4, 6, 15): what a handler gets and how its end is told.

:mod:`dtq.worker.execution` drives each run; this module holds the pieces it uses that know
nothing of Redis:

- :func:`prepare`: the handler's arguments, or the outcome of an entry that cannot run (task
  type unknown here, payload not JSON or not valid for the handler's model);
- :class:`ThreadRunner`: sync handlers run on daemon threads (GIL-bound; CPU-heavy work wants
  several processes). A thread that timed out or was cancelled runs on: Python cannot stop it,
  so its slot stays taken until it returns and concurrency stays bounded;
- :func:`succeeded`, :func:`rescheduled`, :func:`failed`: how a run ended, as finish.lua
  records it (an :class:`~dtq.calls.Outcome`; errors classified by :mod:`dtq.retry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtq.calls import Entry, Outcome, StartReply
from dtq.config import Settings
from dtq.models import compact_json
from dtq.retry import PayloadDecodeError, classify, next_retry_delay_s, sanitize
from dtq.store import ms_to_dt
from dtq_tasks import Handler, RescheduleError, TaskContext

__all__ = [
    "Prepared",
    "ThreadRunner",
    "failed",
    "ms_since",
    "prepare",
    "rescheduled",
    "succeeded",
]


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
