"""Fairness across keys, the worker's part (docs/limits.md, "Fairness across keys").

A fair queue (one with a keyed limit) keeps at most ``FAIR_WINDOW`` unread entries in its
streams; submit.lua holds the others in the queue's held zset, in rounds by key. The mover puts
them into the streams in turn: after each start batch of the queue (its entries were read, so
there is room again) and once a second for every served queue (one ZRANGE each when nothing
is held: a queue whose keyed limit was deleted still has its held tasks moved). Every worker of
the queue runs it; fair_move.lua checks the room and the turn itself, so movers never
overfill a stream or move a task twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from dtq import calls
from dtq.store import Store

log = logging.getLogger("dtq.worker.worker")

TICK_S = 1.0
MAX_CALLS = 8  # fair_move calls per queue per wake-up: a turn never runs long


class FairMover:
    """Moves the held tasks of one worker's fair queues into their streams."""

    def __init__(
        self, store: Store, queues: Sequence[str], fair: Callable[[], frozenset[str]]
    ) -> None:
        self._store = store
        self._queues = sorted(set(queues))
        self._fair = fair  # the served queues with a keyed limit, as last read
        self._holding: set[str] = set()  # queues found holding tasks at the last move
        self._poked: set[str] = set()
        self._wake = asyncio.Event()
        self._full_at = 0.0  # the event loop's time of the last pass over every served queue

    def poke(self, queue: str) -> None:
        """A start batch of ``queue`` ran: its streams may have room."""
        if queue in self._holding or queue in self._fair():
            self._poked.add(queue)
            self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Until the worker stops (at once: the wait ends with ``stopping`` too)."""
        stop = asyncio.ensure_future(stopping.wait())
        try:
            while not stopping.is_set():
                wake = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait((wake, stop), timeout=TICK_S, return_when="FIRST_COMPLETED")
                wake.cancel()
                if stopping.is_set():
                    return
                self._wake.clear()
                await self._pass()
        finally:
            stop.cancel()

    async def _pass(self) -> None:
        """The poked queues; every served queue once a second, however often pokes come (a
        queue holding tasks behind an empty stream is never poked)."""
        now = asyncio.get_running_loop().time()
        if now - self._full_at >= TICK_S:
            self._full_at = now
            queues, self._poked = self._queues, set()
        else:
            queues, self._poked = sorted(self._poked), set()
        for queue in queues:
            await self.move(queue)

    async def move(self, queue: str) -> int:
        """Move what fits of ``queue``'s held tasks; how many moved."""
        total = 0
        for _ in range(MAX_CALLS):
            got = await calls.fair_move(self._store, queue)
            total += got.moved
            if got.held:
                self._holding.add(queue)
            else:
                self._holding.discard(queue)
            if not got.stale and (got.moved < calls.FAIR_WINDOW or not got.held):
                break
        return total
