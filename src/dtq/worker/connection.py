"""The worker's Redis client.

The hot path sends two scripts per task with about 25 arguments each; redis-py's asyncio client
packs commands in pure Python, which costs more CPU than everything else the worker does per
task. Where hiredis is installed (dtq depends on ``redis[hiredis]``) the worker's connections
pack with it, as redis-py's sync client already does. The wire format is the same.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

from dtq.config import Settings

__all__ = ["worker_redis"]

try:
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # pragma: no cover - an older redis-py: the default packer
    HIREDIS_AVAILABLE = False

_SOCKET_TIMEOUT_S = 10.0


if HIREDIS_AVAILABLE:
    _SERIALIZER = HiredisRespSerializer()

    class _HiredisPacking:
        def pack_command(self, *args: Any) -> list[bytes]:
            packed: list[bytes] = _SERIALIZER.pack(*args)
            return packed

    class _TcpConnection(_HiredisPacking, Connection):
        pass

    class _SslConnection(_HiredisPacking, SSLConnection):
        pass

    class _UnixConnection(_HiredisPacking, UnixDomainSocketConnection):
        pass


def worker_redis(settings: Settings) -> Redis:
    """An asyncio client for ``DTQ_REDIS_URL`` (decoded strings, bounded socket timeouts)."""
    client = Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_connect_timeout=5,
        socket_timeout=_SOCKET_TIMEOUT_S,
        health_check_interval=30,
    )
    if HIREDIS_AVAILABLE:
        pool = client.connection_pool
        # The URL's scheme chose the class; keep its kind, pack with hiredis.
        for base, fast in (
            (UnixDomainSocketConnection, _UnixConnection),
            (SSLConnection, _SslConnection),
            (Connection, _TcpConnection),
        ):
            if issubclass(pool.connection_class, base):
                pool.connection_class = fast
                break
    return client
