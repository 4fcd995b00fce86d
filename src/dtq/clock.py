"""The one clock: Redis server time (DESIGN 5).

Scripts read ``TIME`` themselves. Processes keep an offset to the server clock, sampled at
connect and at every heartbeat (the API's gauges: at every scrape), so a process whose own
clock is wrong still agrees with Redis. Every sample goes through :meth:`RedisClock.observe`:
``TIME``'s reply and the local clock just before the command was sent and just after it was
answered; the offset is taken at the midpoint of that round trip.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis
    from redis.asyncio import Redis

__all__ = ["RedisClock", "local_ms", "redis_time_ms", "time_reply_ms"]


def local_ms() -> float:
    """This host's clock in epoch milliseconds: only ever corrected by an offset to Redis."""
    return time.time() * 1000


def time_reply_ms(reply: Sequence[Any]) -> int:
    """``TIME``'s reply (seconds, microseconds) in epoch milliseconds."""
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000


async def redis_time_ms(redis: Redis) -> int:
    return time_reply_ms(await redis.time())


class RedisClock:
    """Local time corrected by the last measured offset to the Redis server's clock."""

    def __init__(self) -> None:
        self.offset_ms = 0.0

    def observe(self, reply: Sequence[Any], before_ms: float, after_ms: float) -> int:
        """Take one sample: ``TIME``'s reply, sent at ``before_ms`` and answered at
        ``after_ms`` (:func:`local_ms`). Returns the server time in ms."""
        server_ms = time_reply_ms(reply)
        self.offset_ms = server_ms - (before_ms + after_ms) / 2
        return server_ms

    async def sync(self, redis: Redis) -> int:
        """Sample the offset with an asyncio client; returns the server time in ms."""
        before = local_ms()
        reply = await redis.time()
        return self.observe(reply, before, local_ms())

    def sync_blocking(self, redis: redis.Redis) -> int:
        """Sample the offset with a blocking client (the heartbeat thread's)."""
        before = local_ms()
        reply = redis.time()
        return self.observe(reply, before, local_ms())

    def now_ms(self) -> int:
        return int(time.time() * 1000 + self.offset_ms)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.now_ms() / 1000, tz=UTC)
