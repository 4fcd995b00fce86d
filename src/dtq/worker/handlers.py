"""Running one started entry's handler (contract sections 4, 6, 15): the run step between
:mod:`dtq.worker.execution`'s start and :mod:`dtq.worker.finish`.

:meth:`Runner.run`, in order: the handler's arguments (:func:`prepare`: or the outcome of an
entry that cannot run, task type unknown here, payload not JSON or not valid for the
handler's model); the handler task, which checks the lease right before the handler is called
(:meth:`Runner._lease_held`) and runs it under ``timeout_ms``; then how it ended, as finish.lua
records it (:func:`succeeded`, :func:`rescheduled`, :func:`rate_limited`, :func:`failed`: an
:class:`~dtq.calls.Outcome`, errors classified by :mod:`dtq.retry`).

Sync handlers run on the daemon threads of a :class:`~dtq.worker.threads.ThreadRunner`
(GIL-bound; CPU-heavy work wants several processes). One that passes its ``timeout_ms`` is
interrupted: an asynchronous exception (:class:`~dtq_tasks.TimeLimitExceeded`;
:class:`~dtq_tasks.TaskCancelled` for a cancel) is raised in its thread, at its next Python
bytecode. The attempt's end is recorded only once the thread has ended, so its next attempt
never starts while it still runs: meanwhile the entry stays in flight (the heartbeat renews it,
no peer reclaims it) and the slot stays taken. A thread still running ``INTERRUPT_GRACE_S``
after its interrupt (C code that does not return to the interpreter, or a handler that
swallows the exception) is logged once; its task stays RUNNING until it returns. At shutdown
the wait is bounded: the worker leaves the entry for a peer (a crash redelivery). See
docs/delivery-guarantees.md, "Sync handlers".
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from dtq import calls, keys
from dtq.admin.workflows import parent_results
from dtq.calls import Entry, Outcome, StartReply
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.models import compact_json
from dtq.retry import PayloadDecodeError, classify, next_retry_delay_s, sanitize
from dtq.schedules import firing_of
from dtq.store import Store, ms_to_dt
from dtq.waits import HANDLER_QUEUES
from dtq.worker.outage import TRANSIENT
from dtq.worker.progress import ProgressReporter
from dtq.worker.threads import ThreadJob, ThreadRunner
from dtq.workflows import parse_node_key
from dtq_tasks import (
    Handler,
    RateLimited,
    RescheduleError,
    TaskCancelled,
    TaskContext,
    TimeLimitExceeded,
)
from dtq_tasks.errors import retry_after_problem
from dtq_tasks.registry import ProgressFn

__all__ = [
    "INTERRUPT_GRACE_S",
    "Execution",
    "Prepared",
    "Runner",
    "failed",
    "ms_since",
    "prepare",
    "rate_limited",
    "rescheduled",
    "succeeded",
]

log = logging.getLogger("dtq.worker.worker")

INTERRUPT_GRACE_S = 2.0
"""How long an interrupted sync handler's thread may take to end before it is reported (and,
at shutdown, before the worker stops waiting for it)."""


@dataclass(eq=False)
class Execution:
    """One started entry, from its start reply until its finish reply.

    ``cancel_reason``: ``user`` (a cancel request: finished CANCELLED), ``shutdown`` (the drain
    timeout passed) or ``lost`` (another worker holds the entry): the last two write nothing
    and leave the entry pending for a peer. ``job``: a sync handler's call on its thread.
    ``thread_wait``: set while the handler has ended (timed out, cancelled) but its thread still
    runs, so the finish waits; ``overdue``: that thread outlived its interrupt by
    :data:`INTERRUPT_GRACE_S`.
    """

    entry: Entry
    start: StartReply
    handler_task: asyncio.Task[Any] | None = None
    cancel_reason: str | None = None
    finishing: bool = False
    handler_started: bool = False  # the lease check passed and the handler was called
    job: ThreadJob | None = None
    thread_wait: asyncio.Event | None = None
    overdue: bool = False
    cancel_noted: bool = False  # a cancel request met a timed-out thread: logged once

    @property
    def attempt(self) -> int:
        return self.start.attempt

    @property
    def thread(self) -> asyncio.Future[Any] | None:
        """A sync handler's result: done once its thread has returned."""
        return None if self.job is None else self.job.future

    def cancel(self, reason: str) -> bool:
        """Stop the handler (not the bookkeeping); False when it is past that point.

        While the finish waits for a timed-out handler's thread, a shutdown or a lost lease
        stops the waiting (nothing is recorded); a user's cancel does not: the attempt's end
        is decided, and finish.lua makes a retry of a task whose cancel was requested
        CANCELLED."""
        if self.finishing:
            return False
        if self.thread_wait is not None:
            if reason == "user" or self.thread_wait.is_set():
                return False
            self.cancel_reason = reason
            self.thread_wait.set()
            return True
        if self.cancel_reason is not None:
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
        queues: Sequence[str] = (),
    ) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.store = store
        self.handlers = handlers
        self.clock = clock
        self.threads = threads
        self._rng = rng
        self._queues = frozenset(queues)  # a handler's wait on one of these logs a warning
        self.progress = ProgressReporter(store, worker_id)  # ctx.progress() of every execution

    async def run(self, ex: Execution) -> Outcome | None:
        """Run one started entry's handler; None when it was stopped for shutdown or a lost
        lease (nothing is recorded: the entry stays pending for a peer)."""
        entry, start, settings = ex.entry, ex.start, self.settings
        call = prepare(
            entry,
            start,
            self.handlers.get(entry.task_type),
            self.worker_id,
            settings,
            self._rng,
            self.progress.report,
        )
        if isinstance(call, Outcome):
            return call
        node = parse_node_key(entry.idempotency_key)
        if node is not None:
            # A workflow's node reads its parents' ends before it runs (docs/workflows.md).
            try:
                parents = await parent_results(self.store, *node)
            except Exception as exc:  # Redis went away: a retryable error like any other
                return failed(exc, start, settings, self._rng)
            call.ctx = replace(call.ctx, workflow_id=node[0], node=node[1], parent_results=parents)
        t0 = time.monotonic()
        ex.handler_task = asyncio.create_task(self._call(ex, call))
        if ex.cancel_reason is not None:  # cancelled before the handler got going
            ex.handler_task.cancel()
        outcome: Outcome | None
        try:
            result = await ex.handler_task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if ex.cancel_reason == "user":
                outcome = Outcome("cancelled", duration_ms=ms_since(t0))
            elif ex.cancel_reason is not None:
                outcome = None
            elif current is not None and current.cancelling():
                raise
            else:  # the handler cancelled itself: an error like any other (permanent)
                error = asyncio.CancelledError("handler was cancelled")
                outcome = failed(error, start, settings, self._rng, t0)
        except LeaseLostError:
            ex.cancel_reason = "lost"
            return None
        except RescheduleError as exc:
            outcome = rescheduled(exc, t0)
        except RateLimited as exc:
            outcome = rate_limited(exc, start, settings, self._rng, t0)
        except Exception as exc:
            outcome = failed(exc, start, settings, self._rng, t0)
        else:
            outcome = succeeded(result, t0, settings)
        if ex.job is not None and not ex.job.future.done():  # timed out or stopped: its thread
            return await self._thread_ended(ex, ex.job, outcome)
        return outcome

    async def _call(self, ex: Execution, call: Prepared) -> Any:
        """The handler task: the lease check, then the handler under its timeout. Nothing is
        awaited between a passed check and the handler's first line (a failed or slow check
        is the only await), so a pause of the process cannot fall in between."""
        if not await self._lease_held(ex):
            raise LeaseLostError
        ex.handler_started = True
        HANDLER_QUEUES.set(self._queues)  # this task's own context, copied into a thread's
        handler = call.handler
        if handler.is_async:
            async with asyncio.timeout(call.timeout_s):
                return await handler.fn(call.payload, call.ctx)
        ex.job = job = self.threads.submit(handler.fn, call.payload, call.ctx)
        job.future.add_done_callback(_retrieve)
        async with asyncio.timeout(call.timeout_s):
            return await asyncio.shield(job.future)

    async def _thread_ended(
        self, ex: Execution, job: ThreadJob, outcome: Outcome | None
    ) -> Outcome | None:
        """The handler ended (timed out, cancelled) while its thread still runs: interrupt it,
        then wait until it has ended before ``outcome`` is recorded, the entry renewed by the
        heartbeat meanwhile. A lost lease does not wait (the entry is another worker's); a
        shutdown waits :data:`INTERRUPT_GRACE_S` at most and records nothing (a peer takes the
        entry over). The slot comes back when the thread returns (the executor's release)."""
        reason = ex.cancel_reason
        self.threads.interrupt(
            job, TimeLimitExceeded if reason in (None, "shutdown") else TaskCancelled
        )
        if reason == "lost":
            return None
        if reason == "shutdown":
            await asyncio.wait({job.future}, timeout=INTERRUPT_GRACE_S)
            return None
        ex.thread_wait = stop = asyncio.Event()
        stopped = asyncio.ensure_future(stop.wait())
        try:
            waits: set[asyncio.Future[Any]] = {job.future, stopped}
            await asyncio.wait(
                waits, timeout=INTERRUPT_GRACE_S, return_when=asyncio.FIRST_COMPLETED
            )
            if not job.future.done() and not stop.is_set():
                ex.overdue = True
                log.warning(
                    "task %s attempt %d: its sync handler's thread still runs %.1fs after it was "
                    "interrupted (%s); the task stays RUNNING, owned by this worker, until the "
                    "thread returns (code that never returns to the interpreter cannot be "
                    "interrupted)",
                    ex.entry.task_id,
                    ex.attempt,
                    INTERRUPT_GRACE_S,
                    "cancel requested" if reason == "user" else "timeout_ms passed",
                )
                await self._note_overdue(ex)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if ex.cancel_reason != reason:
            return None  # shutdown or lost lease while waiting: left for a peer
        return outcome

    async def _note_overdue(self, ex: Execution) -> None:
        """Tell a canceller that this attempt's thread did not stop: ``overdue_attempt`` in the
        task hash (cancel says so while it names the running attempt). Best effort."""
        try:
            await self.store.redis.hset(
                keys.task(ex.entry.task_id), "overdue_attempt", str(ex.attempt)
            )
        except TRANSIENT as exc:
            log.debug("task %s: overdue_attempt not written: %s", ex.entry.task_id, exc)

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
    progress: ProgressFn | None = None,
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
        _progress=progress,
    )
    fired = firing_of(entry.idempotency_key)
    if fired is not None:
        name, tick_ms = fired
        tick_ms = tick_ms if tick_ms is not None else start.created_ms
        ctx = replace(
            ctx, schedule=name, scheduled_for=None if tick_ms is None else ms_to_dt(tick_ms)
        )
    return Prepared(handler, payload, ctx, timeout_ms / 1000)


def succeeded(result: Any, t0: float, settings: Settings) -> Outcome:
    """The handler returned ``result``: stored unless larger than ``DTQ_RESULT_MAX_BYTES``;
    a result that is not JSON ends the attempt as an error. A pydantic model is stored as its
    JSON (what a typed handle's ``result()`` validates back into the model)."""
    duration_ms = ms_since(t0)
    try:
        if isinstance(result, BaseModel):
            result = result.model_dump(mode="json", by_alias=True)
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


def rate_limited(
    exc: RateLimited, start: StartReply, settings: Settings, rng: random.Random, t0: float
) -> Outcome:
    """The handler was pushed back by an upstream: parked ``retry_after_s`` without spending
    the attempt (docs/limits.md, "Back-pressure from a handler"). Arguments that are not what
    :class:`~dtq_tasks.RateLimited` accepts (a subclass can change them) are the handler's
    error, recorded as such with the reason."""
    retry_after_s = getattr(exc, "retry_after_s", None)
    slow = getattr(exc, "slow", None)
    problem = retry_after_problem(retry_after_s, slow)
    if problem is not None:
        return failed(ValueError(problem), start, settings, rng, t0)
    assert isinstance(retry_after_s, int | float) and isinstance(slow, bool)  # checked above
    return Outcome(
        "rate_limited",
        duration_ms=ms_since(t0),
        delay_ms=max(1, math.ceil(retry_after_s * 1000)),
        slow=slow,
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
