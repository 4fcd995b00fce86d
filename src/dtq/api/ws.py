"""WebSocket event fan-out (contract sections 7, 8): ``/ws/events``.

One Redis pub/sub subscription per process (:class:`EventHub`) feeds every connected client
through its own bounded buffer of ``BUFFER_SIZE`` events. It subscribes to ``dtq:events``; with
sharded events (the cluster layout on Redis or Valkey 7.0 and later, :func:`dtq.keys.events`)
it also SSUBSCRIBEs, on the node that serves each, to the shard channel of every queue in
``dtq:queues``, read again every ``QUEUE_REFRESH_S`` (a queue's first events, published before
the hub knew it, can be missed), and at once to the queues a client's ``queue`` filter names
before that client's handshake completes. The slow-client policy, for a client that reads
slower than events arrive:

1. while its buffer has room, every matching event is kept, in order;
2. buffer full, a non-terminal event arrives: that event is dropped;
3. buffer full, a terminal event arrives (``dtq.events.TERMINAL_EVENTS``): the oldest
   non-terminal event in the buffer is dropped to make room, so terminal events are kept;
4. buffer full of terminal events and one more arrives: the client is past the cap. It stops
   receiving new events, gets what its buffer holds (within ``CLOSE_GRACE_S``), and is closed
   with code 1013 (try again later) and a reason naming the cap and the count dropped.

A client's memory is thus bounded by the buffer (plus the transport's own write buffer);
the server never holds more for a client that stops reading. Filters, from the query string:
``queue``, ``task_id`` and ``type`` (each a comma-separated list; an event must match all the
filters given). An unknown event type closes the connection with 1008 and a reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from fastapi import WebSocket, WebSocketDisconnect
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterPubSub
from redis.exceptions import RedisError

from dtq import keys
from dtq.events import TERMINAL_EVENTS
from dtq.models import EVENT_TYPES

__all__ = [
    "BUFFER_SIZE",
    "CLOSE_GRACE_S",
    "QUEUE_REFRESH_S",
    "EventFilter",
    "EventHub",
    "HubStats",
    "Subscriber",
    "serve_client",
]

log = logging.getLogger("dtq.api.ws")

BUFFER_SIZE = 1000
CLOSE_GRACE_S = 5.0
CLOSE_SLOW = 1013  # "try again later": the client could not keep up
CLOSE_POLICY = 1008  # bad filter
_RECONNECT_MAX_S = 5.0
QUEUE_REFRESH_S = 1.0  # sharded events: how often dtq:queues is read for new queues
_FOLLOW_WAIT_S = 5.0  # how long a client's handshake waits for its queues' subscriptions
_FOLLOW_MAX = 100  # a filter naming more queues waits for them to be registered
DEFAULT_QUEUE = "default"


@dataclass(frozen=True)
class EventFilter:
    """Which events a client wants; an empty set means any."""

    queues: frozenset[str] = frozenset()
    task_ids: frozenset[str] = frozenset()
    types: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, queue: str | None, task_id: str | None, etype: str | None) -> EventFilter:
        types = _split(etype)
        unknown = sorted(t for t in types if t not in EVENT_TYPES)
        if unknown:
            raise ValueError(f"unknown event type(s): {', '.join(unknown)}")
        return cls(_split(queue), _split(task_id), types)

    def matches(self, etype: str, queue: str | None, task_id: str | None) -> bool:
        return (
            (not self.types or etype in self.types)
            and (not self.queues or queue in self.queues)
            and (not self.task_ids or task_id in self.task_ids)
        )


def _split(value: str | None) -> frozenset[str]:
    return frozenset(v.strip() for v in (value or "").split(",") if v.strip())


@dataclass(eq=False)
class Subscriber:
    """One client's bounded buffer and the policy above."""

    filter: EventFilter
    capacity: int = BUFFER_SIZE
    buffer: deque[tuple[str, bool]] = field(default_factory=deque)
    non_terminal: int = 0  # how many buffered events are non-terminal
    dropped: int = 0
    overflowed: bool = False
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, raw: str, terminal: bool) -> None:
        if self.overflowed:
            return
        if len(self.buffer) >= self.capacity:
            if not terminal:
                self.dropped += 1
                return
            if not self._evict_non_terminal():
                self.dropped += 1
                self.overflowed = True
                self.wakeup.set()
                return
        self.buffer.append((raw, terminal))
        if not terminal:
            self.non_terminal += 1
        self.wakeup.set()

    def _evict_non_terminal(self) -> bool:
        if not self.non_terminal:
            return False
        for i, (_, terminal) in enumerate(self.buffer):
            if not terminal:
                del self.buffer[i]
                self.non_terminal -= 1
                self.dropped += 1
                return True
        return False  # pragma: no cover - non_terminal counts the buffer exactly

    def pop(self) -> str | None:
        if not self.buffer:
            return None
        raw, terminal = self.buffer.popleft()
        if not terminal:
            self.non_terminal -= 1
        return raw

    async def wait(self) -> None:
        """Until there is an event to send or the client overflowed."""
        while not self.buffer and not self.overflowed:
            self.wakeup.clear()
            await self.wakeup.wait()


@dataclass
class HubStats:
    clients: int = 0
    events: int = 0
    dropped: int = 0
    disconnected_slow: int = 0
    max_buffered: int = 0


class EventHub:
    """The process's one subscription to the events (``dtq:events``, and with sharded events
    every queue's shard channel), fanned out to subscribers."""

    def __init__(self, redis: Redis, *, refresh_s: float = QUEUE_REFRESH_S) -> None:
        self.redis = redis
        self.refresh_s = refresh_s
        self.subscribers: set[Subscriber] = set()
        self.stats = HubStats()
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._channels: set[str] = set()  # shard channels of the current subscription
        self._wake = asyncio.Event()
        self._followed = asyncio.Condition()
        self._delay = 0.1  # before the next attempt to subscribe again

    def _on_subscribed(self) -> None:
        self._subscribed.set()
        self._delay = 0.1

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dtq-event-hub")
        # Subscribe before serving, so a client connected right after start misses nothing.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), 5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def add(self, flt: EventFilter, capacity: int = BUFFER_SIZE) -> Subscriber:
        sub = Subscriber(flt, capacity)
        self.subscribers.add(sub)
        self.stats.clients = len(self.subscribers)
        return sub

    def remove(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        self.stats.clients = len(self.subscribers)
        self.stats.dropped += sub.dropped
        sub.dropped = 0

    async def follow(self, sub: Subscriber) -> None:
        """With sharded events, subscribe now to the shard channels of the queues ``sub``'s
        filter names (at most ``_FOLLOW_MAX``), if the hub has not (a queue not registered
        yet), waiting up to ``_FOLLOW_WAIT_S`` for it; else nothing."""
        queues = sub.filter.queues
        if not keys.sharded_events() or not queues or len(queues) > _FOLLOW_MAX:
            return
        wanted = {keys.events(q) for q in queues}
        if wanted <= self._channels:
            return
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_FOLLOW_WAIT_S), self._followed:
                await self._followed.wait_for(lambda: wanted <= self._channels)

    def publish_local(self, raw: str) -> None:
        """Hand one raw event to every matching subscriber (the reader calls this)."""
        try:
            ev = json.loads(raw)
            etype = str(ev["type"])
        except (ValueError, KeyError, TypeError):
            log.debug("ignoring a malformed event")
            return
        self.stats.events += 1
        terminal = etype in TERMINAL_EVENTS
        queue, task_id = ev.get("queue"), ev.get("task_id")
        gone: list[Subscriber] = []
        for sub in self.subscribers:
            if not sub.filter.matches(etype, queue, task_id):
                continue
            sub.offer(raw, terminal)
            self.stats.max_buffered = max(self.stats.max_buffered, len(sub.buffer))
            if sub.overflowed:
                gone.append(sub)
        for sub in gone:
            self.stats.disconnected_slow += 1
            self.subscribers.discard(sub)
        self.stats.clients = len(self.subscribers)

    async def _run(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(keys.EVENTS)
                if keys.sharded_events():
                    assert isinstance(pubsub, ClusterPubSub)  # sharded events: cluster layout
                    await self._run_sharded(pubsub)
                else:
                    self._on_subscribed()
                    await self._read(pubsub)
            except (RedisError, OSError) as exc:
                delay = self._delay
                log.warning("event subscription lost (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                self._delay = min(delay * 2, _RECONNECT_MAX_S)
                await _refresh_slots(self.redis)
            finally:
                self._channels = set()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _read(self, pubsub: PubSub) -> None:
        """Hand every message of one connection's subscriptions on, until it fails."""
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is not None and msg.get("type") in ("message", "smessage"):
                data = msg["data"]
                self.publish_local(data if isinstance(data, str) else data.decode())

    def _asked(self) -> set[str]:
        """The queues the filters of connected clients name (each filter up to _FOLLOW_MAX)."""
        asked: set[str] = set()
        for sub in self.subscribers:
            if len(sub.filter.queues) <= _FOLLOW_MAX:
                asked.update(sub.filter.queues)
        return asked

    async def _run_sharded(self, pubsub: ClusterPubSub) -> None:
        """The classic channel's reader, and one reader per node of the shard channels of the
        registered queues and of the queues clients asked for, subscribed again every
        ``refresh_s`` (or at once when a client asks) for the queues that are new. A channel
        stays subscribed until the subscription is made again (after a lost connection): a
        removed queue's costs the server one entry of its subscription table."""
        readers: list[asyncio.Task[None]] = []
        nodes: set[str] = set()

        def read(source: PubSub) -> None:
            reader = asyncio.create_task(self._read(source))
            reader.add_done_callback(lambda _: self._wake.set())
            readers.append(reader)

        read(pubsub)
        try:
            while True:
                registered = cast(set[str], await self.redis.smembers(keys.QUEUES))
                queues = {*registered, *self._asked(), DEFAULT_QUEUE}
                new = [c for c in sorted(map(keys.events, queues)) if c not in self._channels]
                if new:
                    await pubsub.ssubscribe(*new)
                    self._channels.update(new)
                for name, node_pubsub in pubsub.node_pubsub_mapping.items():
                    if name not in nodes:
                        nodes.add(name)
                        read(node_pubsub)
                self._on_subscribed()
                async with self._followed:
                    self._followed.notify_all()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.refresh_s)
                self._wake.clear()
                for reader in readers:
                    if reader.done():
                        reader.result()  # its error ends this subscription
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


async def _refresh_slots(redis: Redis) -> None:
    """On a cluster, read the slot table again before subscribing again: the node that was
    lost may have been replaced by a failover, and a subscription asks no command that would
    have told the client (as a MOVED reply does)."""
    if isinstance(redis, RedisCluster):
        with contextlib.suppress(RedisError, OSError):
            await redis.nodes_manager.initialize()


async def serve_client(ws: WebSocket, hub: EventHub, params: Iterable[tuple[str, str]]) -> None:
    """Run one WebSocket client until it leaves, overflows, or the server stops."""
    query = dict(params)
    rid = ws.scope.get("state", {}).get("request_id")
    headers = [(b"x-request-id", rid.encode("latin-1"))] if isinstance(rid, str) else None
    try:
        flt = EventFilter.parse(query.get("queue"), query.get("task_id"), query.get("type"))
    except ValueError as exc:
        await ws.accept(headers=headers)
        await ws.close(code=CLOSE_POLICY, reason=str(exc)[:120])
        return
    # Subscribed before the handshake completes: once the client sees the connection open,
    # it misses no event published after that.
    sub = hub.add(flt)
    pump: asyncio.Task[None] | None = None
    listen: asyncio.Task[None] | None = None
    try:
        await hub.follow(sub)
        await ws.accept(headers=headers)
        pump = asyncio.create_task(_pump(ws, sub))
        listen = asyncio.create_task(_until_disconnect(ws))
        await asyncio.wait({pump, listen}, return_when=asyncio.FIRST_COMPLETED)
        if sub.overflowed:
            log.info("closed a slow WebSocket client: %d events dropped", sub.dropped)
    finally:
        hub.remove(sub)
        running = [t for t in (pump, listen) if t is not None]
        for t in running:
            t.cancel()
        for t in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def _pump(ws: WebSocket, sub: Subscriber) -> None:
    """Send buffered events in order; after an overflow, flush within the grace, then close."""
    try:
        while True:
            await sub.wait()
            if sub.overflowed:
                async with asyncio.timeout(CLOSE_GRACE_S):
                    while (raw := sub.pop()) is not None:
                        await ws.send_text(raw)
                    reason = f"slow consumer: buffer of {sub.capacity} full, {sub.dropped} dropped"
                    await ws.close(code=CLOSE_SLOW, reason=reason)
                return
            raw = sub.pop()
            if raw is not None:
                await ws.send_text(raw)
    except (WebSocketDisconnect, RuntimeError, OSError, TimeoutError):
        return  # the client left, or did not read within the grace


async def _until_disconnect(ws: WebSocket) -> None:
    """Read (and ignore) what the client sends, until it disconnects."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
