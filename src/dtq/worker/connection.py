"""The worker's Redis client.

The hot path sends two scripts per task with about 25 arguments each; its connections pack
commands with hiredis (:func:`dtq.connection.use_hiredis_packing`), as the SDK's do, and never
retry a command (:func:`dtq.connection.no_retry`).
"""

from __future__ import annotations

from redis.asyncio import Redis

from dtq.config import Settings
from dtq.connection import async_client

__all__ = ["worker_redis"]

_SOCKET_TIMEOUT_S = 10.0


def worker_redis(settings: Settings) -> Redis:
    """An asyncio client for ``DTQ_REDIS_URL`` (decoded strings, bounded socket timeouts, no
    retries)."""
    return async_client(settings, socket_timeout=_SOCKET_TIMEOUT_S)
