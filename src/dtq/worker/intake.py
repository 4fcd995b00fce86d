"""Where a worker's entries come from: the poll loop and the reaper, within free capacity.

- **poll**: strict priority p9 -> p0 across the served queues; one stream at a time and only
  while capacity is left, ``min(free capacity, 64)`` per read, so prefetch never exceeds free
  capacity. Paused queues are skipped (their flags are re-read at least twice a second). With
  nothing to read, one ``XREAD BLOCK 500`` on every served stream wakes the worker as soon as
  any priority gets an entry. It reads from the consumer group's last-delivered ids, sampled
  before the last empty read, so it consumes nothing and an entry that lands on a stream just
  after the read passed it still wakes the worker at once.
- **reaper**: ``XAUTOCLAIM`` p9 -> p0 with min-idle = the visibility timeout, following the
  cursor to ``0-0``, never claiming more than free capacity. Redis 6.2 answers nil for an entry
  deleted while pending and keeps it pending: this consumer's pending ids that are gone from the
  stream are acknowledged and logged. Ids that Redis 7 reports deleted are logged.

Entries go to the worker's ``start`` callback (one pipeline of start scripts per batch); a
stream or group that has vanished (NOGROUP) is created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Container, Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import keys
from dtq.config import Settings
from dtq.store import Store
from dtq.worker.protocol import Entry, parse_read

__all__ = ["BLOCK_MS", "PAUSE_REFRESH_S", "READ_BATCH", "Capacity", "Intake"]

log = logging.getLogger(__name__)

READ_BATCH = 64
BLOCK_MS = 500
PAUSE_REFRESH_S = 0.5


class Capacity:
    """The free execution slots of one worker (``size`` = its concurrency)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self._changed = asyncio.Event()

    @property
    def used(self) -> int:
        return self.size - self.free

    async def reserve(self, most: int, stopping: asyncio.Event) -> int:
        """Wait for a free slot, then take up to ``most`` (0 once ``stopping`` is set)."""
        while self.free <= 0 and not stopping.is_set():
            self._changed.clear()
            stop = asyncio.ensure_future(stopping.wait())
            freed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({stop, freed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                freed.cancel()
        if stopping.is_set():
            return 0
        return self.take(most)

    def take(self, most: int) -> int:
        """Take up to ``most`` free slots now, without waiting."""
        n = max(0, min(self.free, most))
        self.free -= n
        return n

    def release(self, n: int = 1) -> None:
        if n > 0:
            self.free += n
            self._changed.set()


StartFn = Callable[[Sequence[Entry]], Awaitable[None]]


class Intake:
    """The poll loop and the reaper of one worker."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        worker_id: str,
        queues: Sequence[str],
        capacity: Capacity,
        start: StartFn,
        in_flight: Container[str],
    ) -> None:
        self.store = store
        self.redis: Redis = store.redis
        self.settings = settings
        self.worker_id = worker_id
        self.queues = list(queues)
        self.capacity = capacity
        self._start = start
        self._in_flight = in_flight
        self._paused: set[str] = set()
        self._paused_at = -1.0

    async def active_streams(self) -> list[str]:
        """Streams of the queues not paused, p9 first across all queues."""
        now = asyncio.get_running_loop().time()
        if now - self._paused_at >= PAUSE_REFRESH_S:
            flags = await self.redis.mget([keys.queue_paused(q) for q in self.queues])
            paused = {q for q, f in zip(self.queues, flags, strict=True) if f == "1"}
            if paused != self._paused:
                log.info("worker %s: paused queues now %s", self.worker_id, sorted(paused) or "-")
            self._paused = paused
            self._paused_at = now
        served = [q for q in self.queues if q not in self._paused]
        return [keys.stream(q, p) for p in keys.PRIORITIES for q in served]

    # -- poll -----------------------------------------------------------------------------------

    async def poll(self, stopping: asyncio.Event) -> None:
        """Read, start, repeat; block when there is nothing to read; return once stopping."""
        idle = False
        while not stopping.is_set():
            streams = await self.active_streams()
            if not streams:
                await _wait(stopping, PAUSE_REFRESH_S)
                continue
            n = await self.capacity.reserve(READ_BATCH, stopping)
            if n == 0:
                return
            try:
                since = await self._last_delivered(streams) if idle else None
                entries = await self._read(streams, n)
            except BaseException:
                self.capacity.release(n)
                raise
            self.capacity.release(n - len(entries))
            if entries:
                idle = False
                await asyncio.shield(self._start(entries))  # read entries are always started
            elif since is None:
                idle = True  # sample, read once more, then block
            else:
                await self.redis.xread(
                    {s: since.get(s, "$") for s in streams}, count=1, block=BLOCK_MS
                )

    async def _last_delivered(self, streams: Sequence[str]) -> dict[str, str]:
        """The consumer group's last-delivered id of each stream (one pipeline)."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        out: dict[str, str] = {}
        for stream, groups in zip(streams, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(groups, Exception):
                continue  # no stream yet: "$" (its first entry creates it)
            for g in groups:
                if g.get("name") == keys.CONSUMER_GROUP:
                    out[stream] = str(g["last-delivered-id"])
        return out

    async def _read(self, streams: Sequence[str], capacity: int) -> list[Entry]:
        """Strict priority: each stream in order, only while capacity is left."""
        got: list[Entry] = []
        for stream in streams:
            left = capacity - len(got)
            if left <= 0:
                break
            try:
                reply = await self.redis.xreadgroup(
                    keys.CONSUMER_GROUP, self.worker_id, {stream: ">"}, count=left
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.store.ensure_groups(keys.stream_queue(stream)[0])
                continue
            entries, bad = parse_read(cast(list[Any], reply))
            got.extend(entries)
            if bad:
                await self._drop_unusable(bad)
        return got

    async def _drop_unusable(self, bad: Sequence[tuple[str, str]]) -> None:
        """Entries without a task id cannot belong to any task: ACK + XDEL, and say so."""
        pipe = self.redis.pipeline(transaction=False)
        for stream, entry_id in bad:
            log.error(
                "stream %s entry %s has no task fields: acknowledged and deleted", stream, entry_id
            )
            pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
        await pipe.execute()

    # -- reaper ---------------------------------------------------------------------------------

    async def reap(self, stopping: asyncio.Event, interval_s: Callable[[], float]) -> None:
        while not stopping.is_set():
            await _wait(stopping, interval_s())
            if stopping.is_set():
                return
            await self.reap_once()

    async def reap_once(self) -> int:
        """Claim entries idle past the visibility timeout; returns how many were started."""
        min_idle_ms = round(self.settings.visibility_timeout_s * 1000)
        started = 0
        for stream in await self.active_streams():
            cursor = "0-0"
            while True:
                n = self.capacity.take(READ_BATCH)
                if n == 0:
                    return started
                try:
                    reply = await self.redis.xautoclaim(
                        stream, keys.CONSUMER_GROUP, self.worker_id, min_idle_ms, cursor, count=n
                    )
                except ResponseError as exc:
                    self.capacity.release(n)
                    if "NOGROUP" not in str(exc):
                        raise
                    await self.store.ensure_groups(keys.stream_queue(stream)[0])
                    break
                except BaseException:
                    self.capacity.release(n)
                    raise
                cursor = str(reply[0])
                entries, bad, nil = _claimed(stream, reply[1])
                self.capacity.release(n - len(entries))
                if entries:
                    log.warning(
                        "reaper: reclaimed %d entr%s idle over %dms from %s",
                        len(entries),
                        "y" if len(entries) == 1 else "ies",
                        min_idle_ms,
                        stream,
                    )
                    started += len(entries)
                    await asyncio.shield(self._start(entries))
                if bad:
                    await self._drop_unusable(bad)
                if nil:
                    await self._resolve_deleted(stream)
                if len(reply) > 2 and reply[2]:
                    log.error(
                        "reaper: entries deleted from %s while pending (Redis removed them from "
                        "the pending list): %s",
                        stream,
                        ", ".join(map(str, reply[2])),
                    )
                if cursor == "0-0":
                    break
        return started

    async def _resolve_deleted(self, stream: str) -> None:
        """Redis 6.2: XAUTOCLAIM answers nil for an entry deleted while pending and leaves it in
        the pending list (now ours). Find such ids among ours that are not in flight, check
        they are gone from the stream, acknowledge them and log each."""
        mine = await self.redis.xpending_range(
            stream, keys.CONSUMER_GROUP, "-", "+", 1000, consumername=self.worker_id
        )
        candidates = [
            str(p["message_id"]) for p in mine if str(p["message_id"]) not in self._in_flight
        ]
        if not candidates:
            return
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in candidates:
            pipe.xrange(stream, entry_id, entry_id)
        gone = [i for i, r in zip(candidates, await pipe.execute(), strict=True) if not r]
        if gone:
            await self.redis.xack(stream, keys.CONSUMER_GROUP, *gone)
            log.error(
                "reaper: entries %s of %s were deleted while pending: acknowledged; their task "
                "(if any) cannot be found from the stream",
                ", ".join(gone),
                stream,
            )


def _claimed(stream: str, items: Sequence[Any]) -> tuple[list[Entry], list[tuple[str, str]], int]:
    """XAUTOCLAIM's entries -> (usable entries, entries without task fields, nil count)."""
    entries: list[Entry] = []
    bad: list[tuple[str, str]] = []
    nil = 0
    for entry_id, fields in cast(list[tuple[str | None, dict[str, str] | None]], items):
        if entry_id is None:
            nil += 1
            continue
        entry = Entry.parse(stream, entry_id, fields)
        if entry is None:
            bad.append((stream, entry_id))
        else:
            entries.append(entry)
    return entries, bad, nil


async def _wait(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, returning early when ``stopping`` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
