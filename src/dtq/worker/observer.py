"""The worker's lifecycle hooks (STYLE 7): metrics, logs and tests subscribe; the executor knows
nothing of them."""

from __future__ import annotations

from redis.asyncio import Redis

from dtq.calls import Entry, Outcome, StartReply
from dtq.worker.executor import Execution
from dtq.worker.scheduler import TickResult

__all__ = ["WorkerObserver"]


class WorkerObserver:
    """Lifecycle hooks (metrics, logs, tests subscribe); the default does nothing.

    Called on the event loop; an observer must not block or raise.
    """

    def task_started(self, entry: Entry, start: StartReply) -> None:
        """A handler is about to run."""

    def task_skipped(self, entry: Entry, start: StartReply) -> None:
        """The start checks consumed an entry without running it (kind in ``start.kind``)."""

    def task_finished(
        self, ex: Execution, status: str, duration_ms: int, outcome: Outcome | None = None
    ) -> None:
        """finish.lua recorded ``status`` (or ``fenced``); ``outcome`` is how the run ended."""

    async def scheduler_ticked(self, result: TickResult, redis: Redis) -> None:
        """This worker's scheduler (the leader) retried or expired tasks: one call per batch
        (of at most 100) of a tick, with that batch's part of the tick's result."""
