"""Where a worker's entries come from: the poll loops and the reaper, within free capacity.

- **poll** (two loops, DESIGN 3): each read is one ``read.lua`` call, which reads the served
  streams in strict priority order (p9 -> p0 across the queues) until the slots this loop
  reserved are filled, ``min(free capacity, 64)``, so prefetch never exceeds free capacity;
  a paused queue's streams are not read (its flag is checked at every read). A read that
  returned entries starts them in one pipeline and lets a waiting loop read on meanwhile.
  When a read finds nothing, one loop watches every served stream from the ids the script
  returned (each stream's last entry: everything in it was delivered) and the other waits
  until a read finds work again. The watching loop keeps its slots and blocks in
  ``XREADGROUP ... COUNT slots//streams BLOCK 500``, which delivers the first entry of any
  priority added after the read (a wake-up costs that reply and one pipeline of start
  scripts); with fewer slots than streams it blocks in ``XREAD BLOCK 500``, which consumes
  nothing, and reads with ``read.lua`` when woken.
- **adopt**: once, at the start of a worker that replaces a ``--processes`` child that exited,
  the dead child's pending entries are claimed (``adopt.lua``: ``XPENDING`` for that
  consumer and ``XCLAIM`` in one script, so a peer that took one meanwhile keeps it) and
  started at once, within free slots: its supervisor reaped it, so nothing can still be
  running them, and they need not wait out the visibility timeout.
- **reaper**: every ``DTQ_REAPER_INTERVAL_S``, one pipeline of ``XPENDING ... IDLE`` finds the
  entries idle past the visibility timeout (a dead or stalled worker's), then ``XAUTOCLAIM``
  p9 -> p0 with that min-idle, following the cursor to ``0-0``. It claims only slots it holds,
  but its reservations go ahead of the poll loops' (:meth:`Executor.reserve
  <dtq.worker.execution.Executor.reserve>` ``urgent``): on
  a fully busy worker the next slots to free go to reclaimed entries, never to fresh reads,
  and the worker never runs more than its concurrency. The reaper serves the streams of paused
  queues too: their pending entries were delivered before the pause (a read batch is always
  started) and most had started; a dead worker's are redelivered (and a cancel asked
  meanwhile is honoured by start.lua) whether the queue is paused or not.
  An entry removed from its stream while pending (``XDEL``, ``XTRIM``) leaves the pending list
  here: Redis 7 drops it itself and lists its id in ``XAUTOCLAIM``'s reply; Redis 6.2 answers
  nil for it and keeps it pending (now this consumer's), so this consumer's pending ids that
  are gone from the stream are acknowledged. Either way its task (which no index finds by
  entry id) is then resolved by the scheduler leader's pass over the task hashes
  (:mod:`dtq.worker.lost_entries`: a new entry, a crash redelivery for a started task).

A read or claim whose reply a lost connection may have taken has delivered entries this
worker does not know: once Redis answers, the poll loop starts every entry pending for this
worker that it does not hold, and the entries of a start batch whose reply was lost are
started again as resumes (:meth:`Executor.start <dtq.worker.execution.Executor.start>`;
docs/delivery-guarantees.md, "Replies lost on the wire").

Every read holds slots reserved from the executor first (:mod:`dtq.worker.execution`, which
keeps the worker's capacity), and what it returns goes to :meth:`Executor.start
<dtq.worker.execution.Executor.start>` with those slots (one pipeline of start scripts per
batch); a stream or group that has vanished (NOGROUP) is created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import calls, keys
from dtq.calls import Entry, ReadPlan, ReadReply, entry_key, parse_read
from dtq.config import Settings
from dtq.store import Store
from dtq.worker.execution import Executor, wait_first
from dtq.worker.outage import TRANSIENT

__all__ = ["BLOCK_MS", "PAUSE_REFRESH_S", "READ_BATCH", "Intake"]

log = logging.getLogger(__name__)

READ_BATCH = 64
BLOCK_MS = 500
PAUSE_REFRESH_S = 0.5


class Intake:
    """The poll loops and the reaper of one worker."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        worker_id: str,
        queues: Sequence[str],
        execution: Executor,
        stopping: asyncio.Event,
    ) -> None:
        self.store = store
        self.redis: Redis = store.redis
        self.settings = settings
        self.worker_id = worker_id
        self.queues = list(queues)
        self.execution = execution
        self._stopping = stopping
        self._plan = ReadPlan(self.queues, worker_id)
        self._paused: frozenset[str] = frozenset()
        self._blocking = False  # a poll loop is in XREAD BLOCK
        self._found = asyncio.Event()  # a read returned entries: a waiting loop reads too
        self._unknown_pending = False  # a read's reply may have been lost (see poll)

    def active_streams(self) -> list[str]:
        """Streams of the queues not paused (as of the last read), p9 first across queues."""
        return [s for s in self._plan.streams if keys.stream_queue(s)[0] not in self._paused]

    # -- poll -----------------------------------------------------------------------------------

    async def poll(self) -> None:
        """Read, start, repeat; wait when there is nothing to read; return once stopping."""
        while not self._stopping.is_set():
            if self._unknown_pending:
                await self._start_unknown_pending()
            if self.execution.lost:
                await self._resume_lost()
            n = await self.execution.reserve(READ_BATCH, self._stopping)
            if n == 0:
                return
            try:
                got = await self.read(n)
                if (
                    got.since
                    and not self._blocking
                    and n >= len(got.since)
                    and not self._plan.parts  # one slot: a cluster worker of many queues watches
                ):
                    got = await self._read_blocking(got.since, n)
            except BaseException as exc:
                self.execution.give_back(n)
                if isinstance(exc, TRANSIENT):
                    self._unknown_pending = True  # the read may have delivered entries
                raise
            if got.entries:
                self._found.set()
                # Read entries are always started; the slots they do not fill come back.
                await asyncio.shield(self.execution.start(got.entries, n))
                continue
            self.execution.give_back(n)
            if got.nogroup:
                for queue in dict.fromkeys(keys.stream_queue(s)[0] for s in got.nogroup):
                    await self.store.ensure_groups(queue)
            elif not got.since:  # a blocking read that timed out, or every queue paused
                if got.paused.issuperset(self.queues):
                    await _wait(self._stopping, PAUSE_REFRESH_S)
            elif self._blocking:  # another loop watches the streams
                self._found.clear()
                await wait_first(self._stopping, self._found, BLOCK_MS / 1000)
            else:  # too few slots to read every stream blocking: only watch them
                self._blocking = True
                try:
                    await self._watch(got.since)
                finally:
                    self._blocking = False

    async def _watch(self, since: dict[str, str]) -> None:
        """``XREAD BLOCK`` (which consumes nothing) on the empty streams until one gets an entry
        or ``BLOCK_MS`` pass. On a cluster, a queue's streams are one slot and the queues are
        others: one XREAD per queue, concurrently, the first to return ending the wait (the
        others are cancelled: nothing was read, so nothing is lost)."""
        if not self._plan.parts:
            watch: dict[Any, Any] = dict(since)
            await self.redis.xread(watch, count=1, block=BLOCK_MS)
            return
        by_queue: dict[str, dict[Any, Any]] = {}
        for stream, last in since.items():
            by_queue.setdefault(keys.stream_queue(stream)[0], {})[stream] = last
        waits = [
            asyncio.ensure_future(self.redis.xread(w, count=1, block=BLOCK_MS))
            for w in by_queue.values()
        ]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        for w in done:
            w.result()  # a Redis error of the wait is the poll loop's to handle

    async def _start_unknown_pending(self) -> None:
        """After a read or claim whose reply a lost connection may have taken: what it
        delivered is pending for this worker, which does not know it. Start every entry
        pending for this worker that it does not hold (:meth:`Executor.holds
        <dtq.worker.execution.Executor.holds>`), ahead of fresh reads. Each start is fenced by
        start.lua; one that another path starts meanwhile is started once (the executor skips
        an entry being started)."""
        self._unknown_pending = False
        try:
            await self._find_and_start_unknown()
        except BaseException:
            self._unknown_pending = True
            raise

    async def _find_and_start_unknown(self) -> None:
        page = self.execution.slots + READ_BATCH
        streams = self._plan.streams
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending_range(
                stream, keys.CONSUMER_GROUP, "-", "+", page, consumername=self.worker_id
            )
        unknown: list[tuple[str, str]] = []
        for stream, rows in zip(streams, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(rows, ResponseError):
                continue  # no group: nothing was delivered from this stream
            if isinstance(rows, Exception):  # a cluster pipeline's lost node is a reply
                raise rows
            unknown += [
                (stream, str(row["message_id"]))
                for row in rows
                if not self.execution.holds(stream, str(row["message_id"]))
            ]
        if not unknown:
            return
        pipe = self.redis.pipeline(transaction=False)
        for stream, entry_id in unknown:
            pipe.xrange(stream, entry_id, entry_id)
        found: list[Entry] = []
        for (stream, entry_id), got in zip(unknown, await pipe.execute(), strict=True):
            entry = Entry.parse(stream, entry_id, got[0][1]) if got else None
            if entry is not None:  # else deleted, or no task fields: the reaper's
                found.append(entry)
        if not found:
            return
        log.warning(
            "worker %s: starting %d entr%s delivered to it by a read whose reply was lost",
            self.worker_id,
            len(found),
            "y" if len(found) == 1 else "ies",
        )
        while found and not self._stopping.is_set():
            n = await self.execution.reserve(
                min(len(found), READ_BATCH), self._stopping, urgent=True
            )
            if n == 0:
                return
            await asyncio.shield(self.execution.start(found[:n], n))
            del found[:n]

    async def _resume_lost(self) -> None:
        """Start again, as resumes, the entries whose start reply a lost connection took
        (:meth:`Executor.start <dtq.worker.execution.Executor.start>`), ahead of fresh reads:
        they are this worker's, and nothing renews them until they run."""
        while self.execution.lost and not self._stopping.is_set():
            n = await self.execution.reserve(READ_BATCH, self._stopping, urgent=True)
            if n == 0:
                return
            entries = self.execution.lost_entries(n)
            log.warning(
                "worker %s: resuming %d entr%s whose start reply was lost",
                self.worker_id,
                len(entries),
                "y" if len(entries) == 1 else "ies",
            )
            await asyncio.shield(self.execution.start(entries, n))

    async def _read_blocking(self, since: dict[str, str], n: int) -> ReadReply:
        """``XREADGROUP BLOCK`` on the streams that a read just found empty, holding ``n``
        slots: ``COUNT n // len(since)`` per stream, so even entries landing on every stream
        before the command arrives stay within the slots. Redis answers with the first
        stream to get an entry."""
        self._blocking = True
        try:
            reply = await self.redis.xreadgroup(
                keys.CONSUMER_GROUP,
                self.worker_id,
                dict.fromkeys(since, ">"),
                count=n // len(since),
                block=BLOCK_MS,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return ReadReply([], [], list(since), self._paused, {})
        finally:
            self._blocking = False
        entries, bad = parse_read(cast(list[Any], reply))
        if bad:
            await self._drop_unusable(bad)
        return ReadReply(entries, bad, [], self._paused, {})

    async def read(self, n: int) -> ReadReply:
        """One read.lua call for at most ``n`` entries (slots the caller holds)."""
        got = await calls.read(self.store, self._plan, n)
        if got.paused != self._paused:
            log.info("worker %s: paused queues now %s", self.worker_id, sorted(got.paused) or "-")
            self._paused = got.paused
        if got.bad:
            await self._drop_unusable(got.bad)
        return got

    async def _drop_unusable(self, bad: Sequence[tuple[str, str]]) -> None:
        """Entries without usable task fields (:meth:`Entry.parse`) cannot belong to any task:
        ACK + XDEL, and say so."""
        pipe = self.redis.pipeline(transaction=False)
        for stream, entry_id in bad:
            log.error(
                "stream %s entry %s has no usable task fields: acknowledged and deleted",
                stream,
                entry_id,
            )
            pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
        await pipe.execute()

    # -- reaper ---------------------------------------------------------------------------------

    async def reap(self, interval_s: Callable[[], float]) -> None:
        while not self._stopping.is_set():
            await _wait(self._stopping, interval_s())
            if self._stopping.is_set():
                return
            await self.reap_once()

    async def reap_once(self) -> int:
        """Claim and start the entries idle past the visibility timeout, ahead of fresh reads
        (waiting for slots on a busy worker); returns how many were started."""
        min_idle_ms = round(self.settings.visibility_timeout_s * 1000)
        started = 0
        for stream, idle in await self._idle_entries(min_idle_ms):
            cursor, seen = "0-0", 0
            while True:
                want = READ_BATCH if idle is None else min(READ_BATCH, idle - seen)
                n = await self.execution.reserve(want, self._stopping, urgent=True)
                if n == 0:
                    return started
                try:
                    reply = await self.redis.xautoclaim(
                        stream, keys.CONSUMER_GROUP, self.worker_id, min_idle_ms, cursor, count=n
                    )
                except ResponseError as exc:
                    self.execution.give_back(n)
                    if "NOGROUP" not in str(exc):
                        raise
                    await self.store.ensure_groups(keys.stream_queue(stream)[0])
                    break
                except BaseException as exc:
                    self.execution.give_back(n)
                    if isinstance(exc, TRANSIENT):
                        self._unknown_pending = True  # the claim may have run
                    raise
                cursor = str(reply[0])
                deleted = reply[2] if len(reply) > 2 else []
                ran, claimed = await self._start_claimed(
                    stream, reply[1], n, f"reaper: reclaimed {{}} idle over {min_idle_ms}ms"
                )
                started += ran
                seen += claimed + len(deleted)
                if deleted:
                    log.warning(
                        "reaper: entries %s of %s were deleted while pending (Redis removed them "
                        "from the pending list): their tasks get a new entry from the scheduler "
                        "leader's pass",
                        ", ".join(map(str, deleted)),
                        stream,
                    )
                if cursor == "0-0" or (idle is not None and seen >= idle):
                    break
        return started

    async def adopt(self, consumers: Sequence[str]) -> int:
        """Claim and start the entries pending for ``consumers``, worker ids known to be dead
        (a ``--processes`` child its supervisor saw exit and reaped, which this worker replaces),
        at once instead of after the visibility timeout: nothing can still be running them.
        Each claim is adopt.lua, which claims an entry only while XPENDING still names the dead
        consumer as its owner (a peer's reaper may have taken it meanwhile: it stays the
        peer's). Each is a crash redelivery for start.lua (attempt + 1). Only free slots are
        used; what does not fit is left to the reaper. Returns how many were started."""
        started = 0
        for stream in self.active_streams():
            for consumer in consumers:
                n = self.execution.take(READ_BATCH)
                if n == 0:
                    return started
                try:
                    items, gone = await calls.adopt(self.store, stream, self.worker_id, consumer, n)
                except BaseException as exc:
                    self.execution.give_back(n)
                    if isinstance(exc, TRANSIENT):
                        self._unknown_pending = True  # the claim may have run
                    raise
                what = f"taking over {{}} of {consumer} (its process exited)"
                started += (await self._start_claimed(stream, items, n, what))[0]
                if gone:
                    await self._resolve_deleted(stream)
        return started

    async def _start_claimed(
        self, stream: str, items: Sequence[Any], reserved: int, what: str
    ) -> tuple[int, int]:
        """Start what a claim (XAUTOCLAIM, XCLAIM) of ``stream`` returned, in the ``reserved``
        slots (the rest are given back); entries without task fields are dropped, ids deleted
        while pending resolved. ``what``: the log line, ``{}`` for "N entries". Returns (how many
        were started, how many ids the claim returned)."""
        entries, bad, nil = _claimed(stream, items)
        if entries:
            n = len(entries)
            log.warning("%s from %s", what.format(f"{n} entr{'y' if n == 1 else 'ies'}"), stream)
            await asyncio.shield(self.execution.start(entries, reserved))
        else:
            self.execution.give_back(reserved)
        if bad:
            await self._drop_unusable(bad)
        if nil:
            await self._resolve_deleted(stream)
        return len(entries), len(entries) + len(bad) + nil

    async def _idle_entries(self, min_idle_ms: int) -> list[tuple[str, int | None]]:
        """(stream, how many of its entries are idle past ``min_idle_ms``, None for at least a
        full page) of the served streams that have any, p9 first, paused queues' too (the
        module docstring): one pipeline."""
        streams = self._plan.streams
        page = max(self.execution.slots, READ_BATCH)
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", page, idle=min_idle_ms)
        out: list[tuple[str, int | None]] = []
        for stream, rows in zip(streams, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(rows, ResponseError):
                if "NOGROUP" not in str(rows):
                    raise rows
                await self.store.ensure_groups(keys.stream_queue(stream)[0])
            elif isinstance(rows, Exception):  # a cluster pipeline's lost node is a reply
                raise rows
            elif rows:
                out.append((stream, None if len(rows) >= page else len(rows)))
        return out

    async def _resolve_deleted(self, stream: str) -> None:
        """Redis 6.2: XAUTOCLAIM answers nil for an entry deleted while pending and leaves it in
        the pending list (now ours). Find such ids among ours that are not in flight, check
        they are gone from the stream, acknowledge them and log each."""
        mine = await self.redis.xpending_range(
            stream, keys.CONSUMER_GROUP, "-", "+", 1000, consumername=self.worker_id
        )
        candidates = [
            str(p["message_id"])
            for p in mine
            if entry_key(stream, str(p["message_id"])) not in self.execution.inflight
        ]
        if not candidates:
            return
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in candidates:
            pipe.xrange(stream, entry_id, entry_id)
        gone = [i for i, r in zip(candidates, await pipe.execute(), strict=True) if not r]
        if gone:
            await self.redis.xack(stream, keys.CONSUMER_GROUP, *gone)
            log.warning(
                "reaper: entries %s of %s were deleted while pending: acknowledged; their tasks "
                "get a new entry from the scheduler leader's pass",
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
