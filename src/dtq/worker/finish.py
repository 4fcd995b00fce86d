"""How every entry's end is recorded and told (contract sections 4, 6; DESIGN 3).

- An execution that ended (:meth:`Finisher.finish`): its finish script joins the next
  pipeline; everything submitted in one event-loop
  tick goes to Redis together, never one awaited call per task. A lost connection is retried,
  since the script is fenced and atomic: a finish that ran already is fenced the second time
  (its entry is acknowledged) and writes nothing, and what it recorded is read from the task's
  history (:meth:`Finisher._recorded`). The reply is logged and counted, and
  :class:`~dtq.worker.observer.TaskFinished` told.
- An entry its start consumed without running it (:meth:`Finisher.skipped`): logged, counted
  and :class:`~dtq.worker.observer.TaskSkipped` told.

The counts (``tasks_processed``, ``tasks_failed``, ``tasks_retried``) are the worker hash's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import cast

from dtq import calls, keys
from dtq.calls import Entry, FinishReply, Outcome, StartReply
from dtq.config import Settings
from dtq.scripts import Call
from dtq.store import Store
from dtq.worker.observer import TaskFinished, TaskSkipped, WorkerObserver
from dtq.worker.outage import NOT_RUN, TRANSIENT, RedisOutage

__all__ = ["FINISH_BATCH_MAX", "Finisher", "attempt_result"]

log = logging.getLogger("dtq.worker.worker")

FINISH_BATCH_MAX = 512
HISTORY_LOOKBACK = 10  # history entries read to find what a finish whose reply was lost did


class Finisher:
    """The finish pipeline of one worker, and its counts.

    A connection failure is retried with backoff for up to ``retry_budget_s``, and so are the
    calls a Redis Cluster did not run (:data:`~dtq.worker.outage.NOT_RUN`, during a failover);
    after that each such call's reply is the error, and the entry stays pending for the reaper
    of some worker. The failures go to the process's :class:`~dtq.worker.outage.RedisOutage`;
    a batch given up is one line, with its task ids.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        settings: Settings,
        store: Store,
        observers: Sequence[WorkerObserver],
        outage: RedisOutage,
    ) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self._store = store
        self.observers = observers
        self._retry_budget_s = settings.visibility_timeout_s / 2
        self._outage = outage
        self._items: list[tuple[Call, str, asyncio.Future[FinishReply | Exception]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        # Told the queue of a finish that freed a limit's place (docs/limits.md): the worker
        # promotes that queue's due tasks at once, the waiter among them.
        self.on_freed: Callable[[str], None] | None = None
        self.tasks_processed = 0
        self.tasks_failed = 0
        self.tasks_retried = 0

    # -- the end of an entry ----------------------------------------------------------------------

    def skipped(self, entry: Entry, start: StartReply) -> None:
        """start.lua consumed ``entry`` without running it."""
        if start.kind == "throttled":  # a limit's everyday work: counted, not logged
            level = logging.DEBUG
        elif start.kind in {"duplicate", "dead", "fenced"}:
            level = logging.WARNING
        else:
            level = logging.INFO
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
        if self.observers:
            event = TaskSkipped(
                entry.task_id,
                entry.queue,
                entry.task_type,
                start.kind,
                start.detail,
                _completed_by_start(start),
            )
            for obs in self.observers:
                obs.task_skipped(event)

    async def finish(self, entry: Entry, start: StartReply, outcome: Outcome, ran: bool) -> str:
        """Record how an execution ended (``ran``: its handler was called): its finish joins
        the next pipeline (the wait is shielded: the call is sent anyway), then the reply is
        logged, counted and told. Returns the status finish.lua recorded, ``fenced``, or
        ``error`` (the finish could not be sent)."""
        call = calls.finish_call(
            entry, start.attempt, outcome, self.worker_id, self.settings, start.limits
        )
        fut: asyncio.Future[FinishReply | Exception] = asyncio.get_running_loop().create_future()
        self._items.append((call, entry.task_id, fut))
        self._wake.set()
        reply = await asyncio.shield(fut)
        if self.on_freed is not None and isinstance(reply, FinishReply) and reply.freed:
            self.on_freed(entry.queue)
        status = self._status(entry, start.attempt, outcome.kind, reply)
        if self.observers:
            event = _finished_event(entry, start, status, outcome, ran)
            for obs in self.observers:
                obs.task_finished(event)
        return status

    def _status(self, entry: Entry, attempt: int, kind: str, reply: FinishReply | Exception) -> str:
        if isinstance(reply, Exception):
            # Redis unavailable: the batch was logged (with this task's id) once.
            level = logging.DEBUG if isinstance(reply, TRANSIENT) else logging.ERROR
            log.log(
                level,
                "finish of task %s attempt %d failed: %s: the entry stays pending",
                entry.task_id,
                attempt,
                reply,
            )
            return "error"
        status = reply.status
        if status == "fenced":
            log.warning(
                "task %s attempt %d: finish fenced (%s): another worker owns it; nothing written",
                entry.task_id,
                attempt,
                reply.detail,
            )
            return status
        self.tasks_processed += 1
        if status in {"failed", "dead_lettered"}:
            self.tasks_failed += 1
        elif status == "retrying" and kind == "error":
            self.tasks_failed += 1
            self.tasks_retried += 1
        log.debug("task %s attempt %d: %s", entry.task_id, attempt, status)
        return status

    # -- the pipeline ---------------------------------------------------------------------------

    def close(self) -> None:
        """Flush what is queued, then let :meth:`run` return."""
        self._closing = True
        self._wake.set()

    async def run(self) -> None:
        """The finisher loop: one pipeline per event-loop tick while finishes are queued."""
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
            replies, resent = await self._send([c for c, _, _ in batch], [t for _, t, _ in batch])
            if resent:
                replies = [
                    await self._recorded(call, reply)
                    for (call, _, _), reply in zip(batch, replies, strict=True)
                ]
            for (_, _, fut), reply in zip(batch, replies, strict=True):
                if not fut.done():
                    fut.set_result(reply)

    async def _recorded(
        self, call: Call, reply: FinishReply | Exception
    ) -> FinishReply | Exception:
        """The reply of a finish sent again after a lost connection. Found fenced with its
        entry no longer pending for another consumer (``not_pending``, or the hash past
        running: ``status:...``, ``entry``, ``attempt``), either the first send ran and only its
        reply was lost, or another worker consumed the entry meanwhile: the task's history
        tells, since only this worker's finish of this execution records a change from running
        by this worker at this attempt after this execution's start (this worker starts no
        entry it has in flight; a rate-limited execution ran the same attempt before). The
        status that first send recorded is returned; nothing is written again. An entry
        pending for another consumer (``owner:...``) was never acknowledged by this worker's
        finish, so that reply stands."""
        if isinstance(reply, Exception) or reply.status != "fenced":
            return reply
        if reply.detail.startswith("owner:"):
            return reply
        args = call[2]
        task_id, attempt = str(args[0]), int(args[4])
        try:
            rows = await self._store.redis.lrange(keys.history(task_id), -HISTORY_LOOKBACK, -1)
        except TRANSIENT:
            return reply
        for row in reversed(rows):
            with contextlib.suppress(ValueError, TypeError):
                change = json.loads(row)
                if change.get("attempt") != attempt or change.get("worker_id") != self.worker_id:
                    continue
                if change.get("to") == "running":
                    # this execution's own start: nothing after it is this finish's (an earlier
                    # execution of the same attempt number, rate limited, is before it)
                    break
                if change.get("from") == "running":
                    status = str(change["to"])
                    log.info(
                        "task %s attempt %d: the finish reply was lost; it had recorded %s",
                        task_id,
                        attempt,
                        status,
                    )
                    delay = change.get("retry_delay_ms", change.get("retry_after_ms"))
                    return FinishReply(status, "" if delay is None else str(delay))
        return reply

    async def _send(
        self, batch: Sequence[Call], task_ids: Sequence[str]
    ) -> tuple[list[FinishReply | Exception], bool]:
        """The batch's replies, and whether it was sent more than once (a lost connection:
        the replies of an earlier send may have been lost after the scripts ran)."""
        resent = False
        started = time.monotonic()
        deadline = started + self._retry_budget_s
        delay_s = 0.05
        replies: list[FinishReply | Exception] | None = None  # once a send was answered
        todo: list[int] = []  # then: the calls the cluster did not run, to send again
        while True:
            try:
                sending = [batch[i] for i in todo] if replies is not None else batch
                got = await calls.finish_many(self._store, sending)
            except TRANSIENT as exc:
                resent = True
                failure: Exception = exc
            except Exception as exc:  # a bug: every caller gets it, the loop goes on
                log.exception("finish pipeline failed")
                return [exc] * len(batch), False
            else:
                if replies is None:
                    replies = got
                else:
                    for i, reply in zip(todo, got, strict=True):
                        replies[i] = reply
                todo = [i for i, reply in enumerate(replies) if isinstance(reply, NOT_RUN)]
                if not todo:
                    self._outage.ok("finish")
                    return replies, resent
                failure = cast(Exception, replies[todo[0]])
            self._outage.failed("finish", failure)
            if time.monotonic() + delay_s > deadline:
                # Told, with the ids, in the outage reporter's next line (one a second).
                if replies is None:
                    self._outage.unrecorded(list(task_ids))
                    return [failure] * len(batch), False
                self._outage.unrecorded([task_ids[i] for i in todo])
                for i in todo:
                    replies[i] = failure
                return replies, resent
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 2.0)


def _completed_by_start(start: StartReply) -> str | None:
    """The terminal status a start that did not run its entry recorded, if it recorded one."""
    if start.kind == "expired":
        return "expired"
    if start.kind == "dead" and start.detail in ("failed", "dead_lettered"):
        return start.detail
    if start.kind == "cancelled" and start.detail:  # cancelled by this start, not before
        return "cancelled"
    return None


def _finished_event(
    entry: Entry, start: StartReply, status: str, outcome: Outcome, ran: bool
) -> TaskFinished:
    latency_ms = None
    if start.created_ms is not None:
        latency_ms = start.started_ms - start.created_ms + outcome.duration_ms
    return TaskFinished(
        entry.task_id,
        entry.queue,
        entry.task_type,
        start.attempt,
        status,
        attempt_result(outcome, ran),
        outcome.duration_ms,
        outcome.duration_ms if ran else None,
        latency_ms,
        outcome.delay_ms if status in ("retrying", "pending") else 0,
    )


def attempt_result(outcome: Outcome, ran: bool) -> str:
    """success | failure | timeout | error (:mod:`dtq.worker.observer`); ``ran``: the handler
    was called."""
    if outcome.kind == "success":
        return "success"
    if outcome.kind in ("reschedule", "rate_limited"):
        return "failure"
    if outcome.kind == "cancelled":
        return "error"
    if not ran or outcome.error_class == "ResultNotSerializable":
        return "error"
    if outcome.error_class == "TimeoutError":
        return "timeout"
    return "failure"
