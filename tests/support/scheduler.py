"""Scheduler helpers: the scheduler's loop in the background of a test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from dtq.worker.scheduler import Scheduler

__all__ = ["running"]


@contextlib.asynccontextmanager
async def running(scheduler: Scheduler) -> AsyncIterator[asyncio.Task[None]]:
    """The scheduler's loop in the background, stopped (and awaited) at the end."""
    stopping = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stopping))
    try:
        yield task
    finally:
        stopping.set()
        await asyncio.wait_for(task, 5)
