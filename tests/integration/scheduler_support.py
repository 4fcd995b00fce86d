"""Helpers shared by the scheduler's and the expiration tests (no tests here): waiting with a
deadline, an event collector on dtq:events, the scheduler's loop in the background."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from redis.asyncio import Redis

from dtq import keys
from dtq.worker.scheduler import Scheduler

__all__ = ["Event", "Events", "running", "wait_until"]


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], within_s: float = 5.0, every_s: float = 0.02
) -> None:
    deadline = time.monotonic() + within_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(every_s)


@dataclass(frozen=True)
class Event:
    """One event as published on dtq:events (contract section 8), parsed for assertions."""

    event_id: str
    ts: datetime
    type: str
    task_id: str | None
    queue: str | None
    task_type: str | None
    attempt: int | None
    worker_id: str | None
    metadata: dict[str, Any]

    @classmethod
    def parse(cls, raw: str | bytes) -> Event:
        data = json.loads(raw)
        metadata = data.get("metadata")
        return cls(
            event_id=data["event_id"],
            ts=datetime.fromisoformat(data["ts"].replace("Z", "+00:00")),
            type=data["type"],
            task_id=data.get("task_id"),
            queue=data.get("queue"),
            task_type=data.get("task_type"),
            attempt=data.get("attempt"),
            worker_id=data.get("worker_id"),
            metadata=metadata if isinstance(metadata, dict) else {},  # cjson encodes {} as []
        )


class Events:
    """Every event published on dtq:events while the block runs."""

    def __init__(self, r: Redis) -> None:
        self.pubsub = r.pubsub()
        self.items: list[Event] = []
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Events:
        await self.pubsub.subscribe(keys.EVENTS)
        while await self.pubsub.get_message(timeout=1.0) is None:  # the subscribe confirmation
            pass
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while True:
            msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if msg is not None:
                self.items.append(Event.parse(msg["data"]))

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._reader is not None
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.pubsub.aclose()

    def of(self, etype: str, task_id: str | None = None) -> list[Event]:
        return [
            e for e in self.items if e.type == etype and (task_id is None or e.task_id == task_id)
        ]

    async def wait_for(self, etype: str, task_id: str | None = None, count: int = 1) -> None:
        async def seen() -> bool:
            return len(self.of(etype, task_id)) >= count

        await wait_until(seen)


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
