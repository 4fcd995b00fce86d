"""Faults on the wire, at the client seam: a connection that loses the reply of a write of
script calls after Redis ran them (the connection is killed with ``CLIENT KILL`` from another
client, so Redis sees it go too), and one that runs a hook right after a reply arrived (another
client acts between two commands of the code under test).

The switches are class attributes of :class:`LosingConnection`, reset by :func:`reset`; a client
on it comes from :func:`losing_client`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, ConnectionPool
from redis.asyncio.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError

_EVALSHA = re.compile(rb"\*\d+\r\n\$7\r\nEVALSHA\r\n")  # the head of one EVALSHA command


class LosingConnection(Connection):
    """Loses the last reply of the next write of script calls, once (``lose_next_script_reply``;
    with ``lose_only``, only a write that contains all of those bytes, e.g. one script's SHA
    and a key): Redis
    ran every script of it and answered, then the connection is killed and that reply never
    arrives. With ``hook``, awaits it once, right after the first reply to a write that contains
    ``hook_on`` was read."""

    lose_next_script_reply = False
    lose_only: tuple[bytes, ...] = ()
    killer: Redis | None = None
    hook: Callable[[], Awaitable[None]] | None = None
    hook_on = b""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        chunks = [command] if isinstance(command, bytes | str) else list(command)
        data = b"".join(c for c in chunks if isinstance(c, bytes | bytearray))
        cls = type(self)
        self._replies_due = 0
        if cls.lose_next_script_reply and all(b in data for b in cls.lose_only):
            self._replies_due = len(_EVALSHA.findall(data))
        self._hook_due = cls.hook is not None and cls.hook_on in data
        await super().send_packed_command(chunks, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        cls = type(self)
        if getattr(self, "_hook_due", False) and cls.hook is not None:
            self._hook_due = False
            hook, cls.hook = cls.hook, None
            await hook()
        if cls.lose_next_script_reply and getattr(self, "_replies_due", 0):
            self._replies_due -= 1
            if not self._replies_due:  # every script of the write has run
                cls.lose_next_script_reply = False
                assert cls.killer is not None
                await cls.killer.client_kill_filter(laddr=self._local_addr())
                await self.disconnect()
                raise RedisConnectionError("connection lost before the reply was read")
        return reply

    def _local_addr(self) -> str:
        sock = self._writer.get_extra_info("socket") if self._writer else None
        assert sock is not None
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}"


def reset(killer: Redis | None = None) -> None:
    """Every switch off; ``killer``: the client that kills a connection whose reply is lost."""
    LosingConnection.lose_next_script_reply = False
    LosingConnection.lose_only = ()
    LosingConnection.killer = killer
    LosingConnection.hook = None
    LosingConnection.hook_on = b""


def losing_client(redis_url: str, retry: Retry, **kwargs: Any) -> Redis:
    """An asyncio client (decoded strings) whose connections are :class:`LosingConnection`."""
    url = urlsplit(redis_url)
    pool = ConnectionPool(
        connection_class=LosingConnection,
        host=url.hostname or "127.0.0.1",
        port=url.port or 6379,
        db=int(url.path.lstrip("/") or 0),
        decode_responses=True,
        retry=retry,
        **kwargs,
    )
    return Redis.from_pool(pool)
