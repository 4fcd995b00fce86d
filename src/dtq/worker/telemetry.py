"""The worker's metrics and lifecycle logs, as subscribers of its hooks (STYLE habit 7).

The engine (:mod:`dtq.worker.worker`) calls :class:`~dtq.worker.worker.WorkerObserver` hooks;
it knows nothing of Prometheus. Here:

- :class:`MetricsObserver` counts starts, attempts and their results, terminal statuses,
  latencies, retries scheduled, start-time expirations, throttles (a limit's park at start, a
  handler's RateLimited at finish), and (scheduler leader) retries promoted and tasks expired
  by the sweep or at promotion, and the limit places its sweep gave back;
- :class:`LogObserver` writes one structured line per execution (``task_id``, ``task_type``,
  ``queue``, ``attempt``, ``status``, ``duration_ms``, ``event_type``);
- :class:`WorkerTelemetry` wires both to a worker and serves its ``/metrics`` on
  ``DTQ_WORKER_METRICS_HOST:DTQ_WORKER_METRICS_PORT`` (0 disables it). A port that cannot be
  bound is logged as an error and the worker runs on without the endpoint: processing tasks
  matters more than exposing numbers, and the scrape target shows as down.

Attempt results are :class:`~dtq.worker.observer.TaskFinished`'s (defined in
:mod:`dtq.worker.observer`). Each hook reads only its event: no Redis, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from dtq.metrics import COMPLETED_STATUSES, Metrics, MetricsServer, count_commands
from dtq.worker.observer import (
    PlacesSwept,
    ScheduleDecisions,
    SchedulerBatch,
    TaskFinished,
    TaskSkipped,
    TaskStarted,
    WorkerObserver,
)

if TYPE_CHECKING:
    from dtq.worker.worker import Worker

__all__ = ["LogObserver", "MetricsObserver", "WorkerTelemetry"]

log = logging.getLogger("dtq.worker.tasks")

EVENT_BY_STATUS = {
    "running": "TASK_STARTED",
    "succeeded": "TASK_SUCCEEDED",
    "retrying": "TASK_RETRY_SCHEDULED",
    "failed": "TASK_FAILED",
    "dead_lettered": "TASK_DEAD_LETTERED",
    "cancelled": "TASK_CANCELLED",
    "expired": "TASK_EXPIRED",
    "pending": "TASK_THROTTLED",  # a handler's RateLimited parked it (docs/limits.md)
}


class MetricsObserver(WorkerObserver):
    """Counts what one worker does into ``metrics``."""

    def __init__(self, metrics: Metrics, worker_id: str) -> None:
        self.metrics = metrics
        self.worker_id = worker_id

    def task_started(self, event: TaskStarted) -> None:
        wait_s = None if event.wait_ms is None else event.wait_ms / 1000
        self.metrics.task_started(event.queue, event.task_type, wait_s)
        if event.throttled_ms is not None:
            self.metrics.throttle_waited(event.queue, event.task_type, event.throttled_ms / 1000)

    def task_skipped(self, event: TaskSkipped) -> None:
        if event.kind == "throttled":
            self.metrics.task_throttled(event.queue, event.task_type)
        elif event.completed is not None:
            self.metrics.task_completed(event.queue, event.task_type, event.completed)

    def task_finished(self, event: TaskFinished) -> None:
        queue, task_type, status = event.queue, event.task_type, event.status
        if status == "fenced":
            return  # another worker owns the task (a stall, a pause): its attempt is counted there
        execution_ms = event.execution_ms
        self.metrics.attempt_ended(
            queue,
            task_type,
            self.worker_id,
            event.result,
            None if execution_ms is None else execution_ms / 1000,
        )
        if status in COMPLETED_STATUSES:
            latency_ms = event.latency_ms
            e2e_s = None if latency_ms is None else latency_ms / 1000
            self.metrics.task_completed(queue, task_type, status, e2e_s)
        elif status == "retrying":
            self.metrics.retry_scheduled(queue, task_type, event.retry_delay_ms / 1000)
        elif status == "pending":  # its handler raised RateLimited: parked like a throttle
            self.metrics.task_throttled(queue, task_type)

    def scheduler_batch(self, event: SchedulerBatch) -> None:
        for queue, task_type in event.retried:
            self.metrics.task_retried(queue, task_type)
        for queue, task_type in event.expired:
            self.metrics.task_completed(queue, task_type, "expired")

    def schedules_fired(self, event: ScheduleDecisions) -> None:
        for queue, task_type, status, n, lag_s in event.decisions:
            self.metrics.schedule_decided(queue, task_type, status, n, lag_s)

    def places_swept(self, event: PlacesSwept) -> None:
        self.metrics.places_swept(event.queue, event.limit, len(event.task_ids))


class LogObserver(WorkerObserver):
    """One line per execution: DEBUG when it starts, INFO when its outcome is recorded (the
    engine itself logs fenced and failed finishes, and entries it consumed without running)."""

    def task_started(self, event: TaskStarted) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "task %s attempt %d started",
                event.task_id,
                event.attempt,
                extra=_fields(event, "running"),
            )

    def task_finished(self, event: TaskFinished) -> None:
        status = event.status
        if status not in EVENT_BY_STATUS:
            return
        fields = _fields(event, status)
        fields["duration_ms"] = event.duration_ms
        if status == "pending":
            log.info(
                "task %s attempt %d: rate limited by its handler after %d ms; parked %d ms, the "
                "attempt not spent",
                event.task_id,
                event.attempt,
                event.duration_ms,
                event.retry_delay_ms,
                extra=fields,
            )
            return
        log.info(
            "task %s attempt %d: %s in %d ms",
            event.task_id,
            event.attempt,
            status,
            event.duration_ms,
            extra=fields,
        )


def _fields(event: TaskStarted | TaskFinished, status: str) -> dict[str, object]:
    return {
        "task_id": event.task_id,
        "task_type": event.task_type,
        "queue": event.queue,
        "attempt": event.attempt,
        "status": status,
        "event_type": EVENT_BY_STATUS.get(status),
    }


class WorkerTelemetry:
    """The metrics (and the endpoint) and lifecycle logs of one worker process.

    Build it before the worker, which takes its :meth:`observers` and its script hook
    (``metrics.script_call``); then :meth:`watch` the worker and :meth:`serve` the endpoint;
    :meth:`stop` at the end.
    """

    def __init__(self, known_types: Collection[str] | None = None) -> None:
        self.metrics = Metrics(known_types=known_types)
        self.server: MetricsServer | None = None

    def observers(self, worker_id: str) -> list[WorkerObserver]:
        """The subscribers of the worker ``worker_id``: its metrics and its lifecycle logs."""
        return [MetricsObserver(self.metrics, worker_id), LogObserver()]

    def watch(self, worker: Worker) -> None:
        """Count the worker's in-flight tasks and the commands its client sends on its own."""
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
