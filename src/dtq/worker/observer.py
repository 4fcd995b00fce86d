"""The worker's lifecycle events and the hooks that receive them (STYLE 7).

Metrics, logs and tests subscribe with a :class:`WorkerObserver`; the executor knows nothing of
them. Each event is a small frozen record of what happened, with its labels (queue, task type,
status, result): an observer gets no Redis client and no piece of the worker, and needs no I/O
to do its work. Hooks are called on the event loop; an observer must not block or raise.

Attempt results (:attr:`TaskFinished.result`): ``success`` the handler returned; ``timeout`` it
passed ``timeout_ms`` (or raised TimeoutError); ``failure`` it raised anything else, or asked
to run later (RescheduleError, RateLimited); ``error`` dtq ended the attempt without the
handler's word: unknown task type, payload not valid, result not JSON, cancelled while running.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Labels",
    "PlacesSwept",
    "ScheduleDecisions",
    "SchedulerBatch",
    "TaskFinished",
    "TaskSkipped",
    "TaskStarted",
    "WorkerObserver",
]

Labels = tuple[str, str]
"""(queue, task_type) of a task."""


@dataclass(frozen=True, slots=True)
class TaskStarted:
    """start.lua made the task RUNNING; its handler is about to run."""

    task_id: str
    queue: str
    task_type: str
    attempt: int
    wait_ms: int | None  # created -> started, on the first attempt of a task that has both
    payload: str  # as delivered (JSON)
    throttled_ms: int | None = None  # first park by a limit -> this start (None: never parked)


@dataclass(frozen=True, slots=True)
class TaskSkipped:
    """start.lua consumed an entry without running it: ``kind`` is missing, terminal,
    cancelled, duplicate, expired, dead, throttled (parked by a limit, ``detail`` its name) or
    fenced, ``detail`` its reason. ``completed`` is the
    terminal status this start recorded (expired, cancelled, failed, dead_lettered), if any."""

    task_id: str
    queue: str
    task_type: str
    kind: str
    detail: str
    completed: str | None


@dataclass(frozen=True, slots=True)
class TaskFinished:
    """An execution ended and finish.lua answered.

    ``status``: what finish.lua recorded (succeeded, retrying, failed, dead_lettered,
    cancelled, or pending: the handler raised RateLimited), ``fenced`` (another worker owns the
    entry: nothing written) or ``error`` (the finish could not be sent: the entry stays
    pending). ``result``: how the attempt ended (see the module docstring). ``execution_ms``:
    the handler's run time, None when it did not run;
    ``latency_ms``: created -> finished, None when the task's creation time is unknown;
    ``retry_delay_ms``: the delay of the retry it scheduled (pending: how long it is parked).
    """

    task_id: str
    queue: str
    task_type: str
    attempt: int
    status: str
    result: str
    duration_ms: int
    execution_ms: int | None
    latency_ms: int | None
    retry_delay_ms: int


@dataclass(frozen=True, slots=True)
class SchedulerBatch:
    """One batch of a scheduler leader's tick (at most 100 tasks): the labels of each task it
    promoted from RETRYING back to its stream, and of each it marked EXPIRED (at promotion or
    by the expiry sweep)."""

    retried: tuple[Labels, ...]
    expired: tuple[Labels, ...]


@dataclass(frozen=True, slots=True)
class ScheduleDecisions:
    """What one pass of this worker's schedule firer decided: per decision, (queue,
    task_type, status, count, lag in seconds or None); status fired (with its lag),
    skipped_overlap, missed (count: the ticks of one gap) or rejected."""

    decisions: tuple[tuple[str, str, str, int, float | None], ...]


@dataclass(frozen=True, slots=True)
class PlacesSwept:
    """This worker's sweep gave back places of concurrency limit ``limit`` (of ``queue``) that
    no RUNNING task held (docs/limits.md, "Places that nothing holds"): their task ids."""

    queue: str
    limit: str
    task_ids: tuple[str, ...]


class WorkerObserver:
    """Lifecycle hooks; the default does nothing."""

    def task_started(self, event: TaskStarted) -> None:
        """A handler is about to run."""

    def task_skipped(self, event: TaskSkipped) -> None:
        """The start checks consumed an entry without running it."""

    def task_finished(self, event: TaskFinished) -> None:
        """An execution's finish was recorded, fenced, or could not be sent."""

    def scheduler_batch(self, event: SchedulerBatch) -> None:
        """This worker's scheduler (the leader) retried or expired tasks."""

    def schedules_fired(self, event: ScheduleDecisions) -> None:
        """This worker's schedule firer decided ticks."""

    def places_swept(self, event: PlacesSwept) -> None:
        """This worker's limit sweep gave back places that no running task held."""
