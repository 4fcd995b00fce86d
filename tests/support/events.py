"""The one collector of ``dtq:events``: every event published while the block runs.

``raw`` keeps each event's JSON object as published (for tests of the wire shape), ``items``
the same events parsed (:class:`dtq.events.Event`), in arrival order. The subscription is
confirmed before the block starts, so nothing published inside it is missed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from types import TracebackType
from typing import Any

from redis.asyncio import Redis

from dtq import keys
from dtq.events import Event
from support.waiting import wait_until

__all__ = ["Events"]


class Events:
    """``async with Events(r) as events:``; then ``events.of(type, task_id)``,
    ``await events.wait_for(type, task_id, count)``, ``await events.settled()``."""

    def __init__(self, r: Redis) -> None:
        self.pubsub = r.pubsub()
        self.raw: list[dict[str, Any]] = []
        self.items: list[Event] = []
        self._last_at = time.monotonic()
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Events:
        await self.pubsub.subscribe(keys.EVENTS)
        confirmed = await self.pubsub.get_message(timeout=5.0)
        assert confirmed is not None and confirmed["type"] == "subscribe", confirmed
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while True:
            msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is not None:
                self.raw.append(json.loads(msg["data"]))
                self.items.append(Event.parse(msg["data"]))
                self._last_at = time.monotonic()

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._reader is not None
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.pubsub.unsubscribe()
        await self.pubsub.aclose()

    def of(self, etype: str, task_id: str | None = None) -> list[Event]:
        return [
            e for e in self.items if e.type == etype and (task_id is None or e.task_id == task_id)
        ]

    async def wait_for(
        self, etype: str, task_id: str | None = None, count: int = 1, timeout_s: float = 10.0
    ) -> list[Event]:
        """Wait until ``count`` events of ``etype`` (for ``task_id``) arrived; returns them."""

        async def seen() -> bool:
            return len(self.of(etype, task_id)) >= count

        await wait_until(seen, timeout_s, f"{count} x {etype} {task_id or ''}".strip())
        return self.of(etype, task_id)

    async def settled(self, idle_s: float = 0.05) -> list[dict[str, Any]]:
        """The raw events once none has arrived for ``idle_s`` (what a change just published)."""

        async def quiet() -> bool:
            return time.monotonic() - self._last_at >= idle_s

        self._last_at = max(self._last_at, time.monotonic())
        await wait_until(quiet, 10.0, "events to settle", every_s=idle_s / 5)
        return self.raw
