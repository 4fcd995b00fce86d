"""The worker's metrics and lifecycle logs, as subscribers of its hooks (STYLE habit 7).

The engine (:mod:`dtq.worker.worker`) calls :class:`~dtq.worker.worker.WorkerObserver` hooks;
it knows nothing of Prometheus. Here:

- :class:`MetricsObserver` counts starts, attempts and their results, terminal statuses,
  latencies, retries scheduled, start-time expirations, and (scheduler leader) retries promoted
  and tasks expired by the sweep or at promotion;
- :class:`LogObserver` writes one structured line per execution (``task_id``, ``task_type``,
  ``queue``, ``attempt``, ``status``, ``duration_ms``, ``event_type``);
- :class:`WorkerTelemetry` wires both to a worker and serves its ``/metrics`` on
  ``DTQ_WORKER_METRICS_HOST:DTQ_WORKER_METRICS_PORT`` (0 disables it). A port that cannot be
  bound is logged as an error and the worker runs on without the endpoint: processing tasks
  matters more than exposing numbers, and the scrape target shows as down.

Attempt results (``dtq_task_attempts_total{result}`` and ``dtq_worker_tasks_total{result}``):
``success`` the handler returned; ``timeout`` it passed ``timeout_ms`` (or raised
TimeoutError); ``failure`` it raised anything else, or asked to run later (RescheduleError);
``error`` dtq ended the attempt without the handler's word: unknown task type, payload not valid,
result not JSON, cancelled while running.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from dtq.calls import Entry, Outcome, StartReply
from dtq.metrics import COMPLETED_STATUSES, Metrics, MetricsServer, count_commands, task_labels
from dtq.worker.executor import Execution
from dtq.worker.scheduler import TickResult
from dtq.worker.worker import WorkerObserver

if TYPE_CHECKING:
    from dtq.worker.worker import Worker

__all__ = ["LogObserver", "MetricsObserver", "WorkerTelemetry", "attempt_result"]

log = logging.getLogger("dtq.worker.tasks")

EVENT_BY_STATUS = {
    "running": "TASK_STARTED",
    "succeeded": "TASK_SUCCEEDED",
    "retrying": "TASK_RETRY_SCHEDULED",
    "failed": "TASK_FAILED",
    "dead_lettered": "TASK_DEAD_LETTERED",
    "cancelled": "TASK_CANCELLED",
    "expired": "TASK_EXPIRED",
}


def attempt_result(ex: Execution, outcome: Outcome) -> str:
    """success | failure | timeout | error (see the module docstring)."""
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


class MetricsObserver(WorkerObserver):
    """Counts what one worker does into ``metrics``."""

    def __init__(self, metrics: Metrics, worker_id: str) -> None:
        self.metrics = metrics
        self.worker_id = worker_id

    def task_started(self, entry: Entry, start: StartReply) -> None:
        wait_s = None
        if start.attempt == 1 and start.created_ms is not None:
            wait_s = (start.started_ms - start.created_ms) / 1000
        self.metrics.task_started(entry.queue, entry.task_type, wait_s)

    def task_skipped(self, entry: Entry, start: StartReply) -> None:
        if start.kind == "expired":
            self.metrics.task_completed(entry.queue, entry.task_type, "expired")
        elif start.kind == "dead" and start.detail in COMPLETED_STATUSES:
            self.metrics.task_completed(entry.queue, entry.task_type, start.detail)
        elif start.kind == "cancelled" and start.detail:  # cancelled by this start, not before
            self.metrics.task_completed(entry.queue, entry.task_type, "cancelled")

    def task_finished(
        self, ex: Execution, status: str, duration_ms: int, outcome: Outcome | None = None
    ) -> None:
        if outcome is None:
            return
        entry, start = ex.entry, ex.start
        ran = ex.handler_task is not None
        self.metrics.attempt_ended(
            entry.queue,
            entry.task_type,
            self.worker_id,
            attempt_result(ex, outcome),
            outcome.duration_ms / 1000 if ran else None,
        )
        if status in COMPLETED_STATUSES:
            e2e_s = None
            if start.created_ms is not None:
                e2e_s = (start.started_ms - start.created_ms + outcome.duration_ms) / 1000
            self.metrics.task_completed(entry.queue, entry.task_type, status, e2e_s)
        elif status == "retrying":
            self.metrics.retry_scheduled(entry.queue, entry.task_type, outcome.delay_ms / 1000)

    async def scheduler_ticked(self, result: TickResult, redis: Redis) -> None:
        # The sweep's replies carry their labels: read only the others (issue 8: reading the
        # labels of thousands of expired tasks held the event loop during an expiry sweep).
        known = result.labels
        unknown = [tid for tid in (*result.retried, *result.expired) if tid not in known]
        labels = {**known, **await task_labels(redis, unknown)}
        for tid in result.retried:
            if tid in labels:
                self.metrics.task_retried(*labels[tid])
        for tid in result.expired:
            if tid in labels:
                queue, task_type = labels[tid]
                self.metrics.task_completed(queue, task_type, "expired")


class LogObserver(WorkerObserver):
    """One line per execution: DEBUG when it starts, INFO when its outcome is recorded (the
    engine itself logs fenced and failed finishes, and entries it consumed without running)."""

    def task_started(self, entry: Entry, start: StartReply) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "task %s attempt %d started",
                entry.task_id,
                start.attempt,
                extra=_fields(entry, start.attempt, "running"),
            )

    def task_finished(
        self, ex: Execution, status: str, duration_ms: int, outcome: Outcome | None = None
    ) -> None:
        if status not in EVENT_BY_STATUS:
            return
        fields = _fields(ex.entry, ex.attempt, status)
        fields["duration_ms"] = duration_ms
        log.info(
            "task %s attempt %d: %s in %d ms",
            ex.entry.task_id,
            ex.attempt,
            status,
            duration_ms,
            extra=fields,
        )


def _fields(entry: Entry, attempt: int, status: str) -> dict[str, object]:
    return {
        "task_id": entry.task_id,
        "task_type": entry.task_type,
        "queue": entry.queue,
        "attempt": attempt,
        "status": status,
        "event_type": EVENT_BY_STATUS.get(status),
    }


class WorkerTelemetry:
    """The metrics (and the endpoint) and lifecycle logs of one worker process.

    Build it before the worker (its :attr:`metrics` gives the worker's script hook), then
    :meth:`attach` the worker and :meth:`serve` the endpoint; :meth:`stop` at the end.
    """

    def __init__(self, known_types: Collection[str] | None = None) -> None:
        self.metrics = Metrics(known_types=known_types)
        self.server: MetricsServer | None = None

    def attach(self, worker: Worker) -> None:
        worker.observers.extend([MetricsObserver(self.metrics, worker.worker_id), LogObserver()])
        self.metrics.track_inflight(worker.worker_id, lambda: len(worker.inflight))
        count_commands(worker.redis, self.metrics.redis_op)

    def serve(self, host: str, port: int) -> MetricsServer | None:
        """Serve ``/metrics`` (port 0: not served). Never raises for a port in use."""
        if port == 0:
            log.info("worker metrics endpoint disabled (DTQ_WORKER_METRICS_PORT=0)")
            return None
        try:
            self.server = MetricsServer(self.metrics.registry, host, port)
        except OSError as exc:
            log.error(
                "worker metrics not served: cannot listen on %s:%d: %s (set "
                "DTQ_WORKER_METRICS_PORT to a free port, or 0 to disable)",
                host,
                port,
                exc.strerror or exc,
            )
            return None
        log.info("worker metrics on http://%s:%d/metrics", host, self.server.port)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
