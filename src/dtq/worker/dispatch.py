"""Starting and finishing a worker's executions: the start scripts of a read batch, one asyncio
task per started entry (:func:`~dtq.worker.executor.run_handler`), its finish script through the
:class:`~dtq.worker.executor.Finisher`, the lease check right before a handler starts, cancel
requests and leases the heartbeat found lost. :class:`~dtq.worker.worker.Worker` owns the loops
and the lifecycle; this owns what is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence

from dtq import calls, keys
from dtq.calls import Entry, FinishReply, Outcome, StartReply
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.log import bind as bind_log_fields
from dtq.store import Store
from dtq.worker.executor import Execution, Finisher, ThreadRunner, run_handler
from dtq.worker.intake import Capacity
from dtq.worker.observer import TaskFinished, TaskSkipped, TaskStarted, WorkerObserver
from dtq.worker.outage import TRANSIENT
from dtq_tasks import Handler

__all__ = ["Dispatcher"]

log = logging.getLogger("dtq.worker.worker")


class Dispatcher:
    """What one worker has in flight (``inflight``: entry id -> execution) and its counts."""

    def __init__(
        self,
        *,
        worker_id: str,
        settings: Settings,
        store: Store,
        handlers: Mapping[str, Handler],
        observers: Sequence[WorkerObserver],
        capacity: Capacity,
        finisher: Finisher,
        clock: RedisClock,
        rng: random.Random,
    ) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.store = store  # what the script calls run against
        self.redis = store.redis
        self.handlers = handlers
        self.observers = observers
        self.capacity = capacity
        self.finisher = finisher
        self.clock = clock
        self._rng = rng
        self.inflight: dict[str, Execution] = {}
        self.executions: set[asyncio.Task[None]] = set()
        self.threads = ThreadRunner(capacity.size)  # sync handlers: one thread per slot at most
        self.tasks_processed = 0
        self.tasks_failed = 0
        self.tasks_retried = 0

    # -- start ----------------------------------------------------------------------------------

    async def start(self, entries: Sequence[Entry]) -> None:
        """One pipeline of start scripts for a read batch; each slot is already reserved."""
        todo = []
        for entry in entries:
            if entry.entry_id in self.inflight:  # reclaimed from ourselves: it is running here
                self.capacity.release()
            else:
                todo.append(entry)
        if not todo:
            return
        try:
            replies = await calls.start_many(self.store, todo, self.worker_id)
        except BaseException:
            self.capacity.release(len(todo))  # entries stay pending: the reaper redelivers them
            raise
        for entry, start in zip(todo, replies, strict=True):
            if isinstance(start, Exception):
                log.error(
                    "start of task %s (entry %s) failed: %s", entry.task_id, entry.entry_id, start
                )
                self.capacity.release()
                continue
            if start.kind != "run":
                self._skipped(entry, start)
                self.capacity.release()
                continue
            self._launch(entry, start)

    def _skipped(self, entry: Entry, start: StartReply) -> None:
        level = logging.WARNING if start.kind in {"duplicate", "dead", "fenced"} else logging.INFO
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

    def _launch(self, entry: Entry, start: StartReply) -> None:
        ex = Execution(
            entry, start, on_release=self.capacity.release, lease_check=self._lease_check
        )
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

    async def _execute(self, ex: Execution) -> None:
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
                self.threads,
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
            call = calls.finish_call(entry, ex.attempt, outcome, self.worker_id, self.settings)
            reply = await asyncio.shield(self.finisher.submit(call, entry.task_id))
            status = self._finished(ex, outcome.kind, reply)
            if self.observers:
                finished = _finished_event(ex, status, outcome)
                for obs in self.observers:
                    obs.task_finished(finished)
        except Exception:  # a bug here must not kill the worker; the entry stays pending
            log.exception(
                "task %s attempt %d: execution failed inside the worker; the entry is left "
                "for redelivery",
                entry.task_id,
                ex.attempt,
            )
        finally:
            self.inflight.pop(entry.entry_id, None)
            ex.drop_hold("execution")

    async def _lease_check(self, ex: Execution) -> bool:
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

    def _finished(self, ex: Execution, kind: str, reply: FinishReply | Exception) -> str:
        entry = ex.entry
        if isinstance(reply, Exception):
            # Redis unavailable: the finisher logged the batch (with this task's id) once.
            level = logging.DEBUG if isinstance(reply, TRANSIENT) else logging.ERROR
            log.log(
                level,
                "finish of task %s attempt %d failed: %s: the entry stays pending",
                entry.task_id,
                ex.attempt,
                reply,
            )
            return "error"
        status = reply.status
        if status == "fenced":
            log.warning(
                "task %s attempt %d: finish fenced (%s): another worker owns it; nothing written",
                entry.task_id,
                ex.attempt,
                reply.detail,
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


def _completed_by_start(start: StartReply) -> str | None:
    """The terminal status a start that did not run its entry recorded, if it recorded one."""
    if start.kind == "expired":
        return "expired"
    if start.kind == "dead" and start.detail in ("failed", "dead_lettered"):
        return start.detail
    if start.kind == "cancelled" and start.detail:  # cancelled by this start, not before
        return "cancelled"
    return None


def attempt_result(ex: Execution, outcome: Outcome) -> str:
    """success | failure | timeout | error (:mod:`dtq.worker.observer`)."""
    if outcome.kind == "success":
        return "success"
    if outcome.kind == "reschedule":
        return "failure"
    if outcome.kind == "cancelled":
        return "error"
    if ex.handler_task is None or outcome.error_class == "ResultNotSerializable":
        return "error"
    if outcome.error_class == "TimeoutError":
        return "timeout"
    return "failure"


def _finished_event(ex: Execution, status: str, outcome: Outcome) -> TaskFinished:
    entry, start = ex.entry, ex.start
    latency_ms = None
    if start.created_ms is not None:
        latency_ms = start.started_ms - start.created_ms + outcome.duration_ms
    return TaskFinished(
        entry.task_id,
        entry.queue,
        entry.task_type,
        start.attempt,
        status,
        attempt_result(ex, outcome),
        outcome.duration_ms,
        outcome.duration_ms if ex.handler_task is not None else None,
        latency_ms,
        outcome.delay_ms if status == "retrying" else 0,
    )
