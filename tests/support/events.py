"""The one collector of ``dtq:events``: every event published while the block runs.

``raw`` keeps each event's JSON object as published (for tests of the wire shape), ``items``
the same events parsed (:class:`Event`), in arrival order. The subscription is
confirmed before the block starts, and :meth:`Events.sync` (also run when the block ends
without an error) waits for everything published before it, so nothing published inside the
block is missed and an assertion that an event did not happen can fail: it publishes a token on
a private channel of the same subscription, and Redis delivers a subscriber's messages in the
order it ran the PUBLISHes.

With sharded events (a cluster whose server has sharded pub/sub: :func:`dtq.keys.events`) a
queue's events are on its own shard channel: ``Events(r, queues=[...])`` names the queues to
follow (``default`` unless told), each SSUBSCRIBEd on its node, and :meth:`Events.sync` also
SPUBLISHes a token on each of them (a text that is not JSON, which the API's hub ignores).

On a Redis Cluster the classic channel's order holds per node only (a PUBLISH reaches the other
nodes over the cluster bus), so the sync token is published on every primary and awaited from
each; the block also starts with a sync, so that an event an earlier test published on another
node, still on its way, is not taken for one of this block's."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import PubSub

from dtq import keys
from support.waiting import wait_until

__all__ = ["Event", "Events"]


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
    """``async with Events(r) as events:``; then ``events.of(type, task_id)``,
    ``await events.wait_for(type, task_id, count)``, ``await events.sync()``."""

    def __init__(self, r: Redis, queues: Iterable[str] = ("default",)) -> None:
        self._r = r
        self._sync_channel = f"test:events-sync:{uuid.uuid4().hex}"
        self._shard_channels = sorted({keys.events(q) for q in queues})
        self._sharded = keys.sharded_events()
        self.pubsub = r.pubsub()
        self.raw: list[dict[str, Any]] = []
        self.items: list[Event] = []
        self._synced: dict[str, tuple[dict[str, int], asyncio.Event]] = {}
        self._readers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Events:
        await self.pubsub.subscribe(keys.EVENTS, self._sync_channel)
        for _ in range(2):
            confirmed = await self.pubsub.get_message(timeout=5.0)
            assert confirmed is not None and confirmed["type"] == "subscribe", confirmed
        self._readers.append(asyncio.create_task(self._read(self.pubsub)))
        if self._sharded and self._shard_channels:
            await self.pubsub.ssubscribe(*self._shard_channels)  # type: ignore[attr-defined]
            for node_pubsub in self.pubsub.node_pubsub_mapping.values():  # type: ignore[attr-defined]
                self._readers.append(asyncio.create_task(self._read(node_pubsub)))
        await self.sync()  # each shard subscription confirmed; nothing older counted
        self.raw.clear()
        self.items.clear()
        return self

    async def _read(self, pubsub: PubSub) -> None:
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None or msg["type"] not in ("message", "smessage"):
                continue
            channel, data = _text(msg["channel"]), _text(msg["data"])
            if channel == self._sync_channel or data.startswith(_TOKEN):
                pending = self._synced.get(data.removeprefix(_TOKEN))
                if pending is not None:
                    left = pending[0]
                    left[channel] = left.get(channel, 1) - 1
                    if all(n <= 0 for n in left.values()):
                        pending[1].set()
                continue
            self.raw.append(json.loads(data))
            self.items.append(Event.parse(data))

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if t is None:
            await self.sync()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
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

    async def sync(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Wait until every event published before this call has arrived; returns ``raw``."""
        token = uuid.uuid4().hex
        shards = self._shard_channels if self._sharded else []
        cluster = isinstance(self._r, RedisCluster)
        primaries = len(self._r.get_primaries()) if isinstance(self._r, RedisCluster) else 1
        arrived = asyncio.Event()
        self._synced[token] = ({self._sync_channel: primaries, **dict.fromkeys(shards, 1)}, arrived)
        try:
            if cluster:  # each primary's own PUBLISH, so every node's earlier messages are in
                await self._r.execute_command(  # type: ignore[no-untyped-call]
                    "PUBLISH", self._sync_channel, token, target_nodes=RedisCluster.PRIMARIES
                )
            else:
                await self._r.publish(self._sync_channel, token)
            for channel in shards:
                await self._r.spublish(channel, _TOKEN + token)
            await asyncio.wait_for(arrived.wait(), timeout_s)
        finally:
            del self._synced[token]
        return self.raw


_TOKEN = "test-sync:"  # a sync token on a shard channel: not JSON, no event


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
