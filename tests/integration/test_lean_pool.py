"""dtq's client pool (dtq.connection.LeanConnectionPool): sequential commands share one
connection, and a command cancelled while it waits leaves nothing for the next one to read."""

from __future__ import annotations

import asyncio
import contextlib

from redis.asyncio import Redis

from dtq.config import Settings
from dtq.connection import LeanConnectionPool, async_client
from support import wait_until


async def connected_clients(r: Redis) -> int:
    return int((await r.info("clients"))["connected_clients"])


async def test_sequential_commands_share_one_connection(settings: Settings, r: Redis) -> None:
    client = async_client(settings)
    try:
        assert isinstance(client.connection_pool, LeanConnectionPool)
        await client.set("k", "v")
        before = await connected_clients(r)
        for i in range(50):
            assert await client.incr("n") == i + 1
        assert await connected_clients(r) == before
    finally:
        await client.aclose()


async def test_a_command_cancelled_while_it_waits_leaves_no_reply_for_the_next(
    settings: Settings, r: Redis
) -> None:
    """A BLPOP cancelled while Redis blocks it: its connection is dropped (redis-py drops a
    connection whose read was interrupted), so the reply that comes later is read by nobody
    and the next command gets its own."""
    client = async_client(settings)
    try:
        await client.set("k", "v")
        blocked = asyncio.create_task(client.blpop(["list"], timeout=30))

        async def blocking() -> bool:
            return (await r.info("clients"))["blocked_clients"] == 1

        await wait_until(blocking, 10, "the BLPOP blocks")
        blocked.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await blocked
        await r.rpush("list", "late")  # what the BLPOP would have popped
        assert await client.get("k") == "v"
        assert await client.lrange("list", 0, -1) == ["late"]
    finally:
        await client.aclose()
