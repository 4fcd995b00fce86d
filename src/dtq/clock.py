"""The one clock: Redis server time (DESIGN 5).

Scripts read ``TIME`` themselves. Processes keep an offset to the server clock, sampled at
connect and at every heartbeat, so a worker whose own clock is wrong still agrees with Redis.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from redis.asyncio import Redis

__all__ = ["RedisClock", "redis_time_ms"]


async def redis_time_ms(redis: Redis) -> int:
    sec, usec = await redis.time()
    return int(sec) * 1000 + int(usec) // 1000


class RedisClock:
    """Local time corrected by the last measured offset to the Redis server's clock."""

    def __init__(self) -> None:
        self.offset_ms = 0.0

    async def sync(self, redis: Redis) -> int:
        """Measure the offset (midpoint of the round trip) and return the server time in ms."""
        before = time.time() * 1000
        server_ms = await redis_time_ms(redis)
        after = time.time() * 1000
        self.offset_ms = server_ms - (before + after) / 2
        return server_ms

    def now_ms(self) -> int:
        return int(time.time() * 1000 + self.offset_ms)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.now_ms() / 1000, tz=UTC)
