"""Redis clients that pack commands with hiredis and never retry, and the start-up check of
Redis's durability settings that the API and the worker share.

redis-py's asyncio client packs every command in pure Python, per argument; a script call
carries 20 to 40 arguments, so packing costs more client CPU than anything else dtq does per
call. Where hiredis is installed (dtq depends on ``redis[hiredis]``) :func:`use_hiredis_packing`
makes a client's connections pack with it, as redis-py's sync client already does. The wire
format is the same. Used by the SDK (:func:`dtq.client.connect`, so the API too) and the worker.

Its pool (:class:`LeanConnectionPool`) hands a connection out and takes it back without what
redis-py 6 and later do around every command that dtq has no use for: OpenTelemetry counters,
a release event for credential providers, and a lock around a pop that nothing can interleave
in one event loop. A single submit's round trip spent about a tenth of its client CPU there.

With ``DTQ_REDIS_SENTINELS`` set, both factories return a client of the primary that the
sentinels name (:mod:`dtq.sentinel`), with the same options.

A retried command may already have run, and dtq's scripts are not replay-safe (a submit or a
start run twice). Every client dtq builds is given :func:`no_retry`, not left to redis-py's
default (none for ``from_url``, ten for ``Redis(host=...)``); :class:`dtq.scripts.Scripts`
never re-sends a script call, whatever client it is handed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import redis as sync_redis
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq import keys
from dtq.sentinel import (
    SentinelConnection,
    SentinelSslConnection,
    primary_client,
    primary_sync_client,
)

if TYPE_CHECKING:
    from dtq.config import Settings

__all__ = [
    "HIREDIS_AVAILABLE",
    "LeanConnectionPool",
    "async_client",
    "choose_events",
    "no_retry",
    "sync_client",
    "use_hiredis_packing",
    "warn_durability",
]


def no_retry() -> Retry:
    """The retry policy of every dtq client: a failed command is raised, never sent again."""
    return Retry(NoBackoff(), 0)


try:
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # pragma: no cover - an older redis-py: the default packer
    HIREDIS_AVAILABLE = False


if HIREDIS_AVAILABLE:
    import hiredis

    _SERIALIZER = HiredisRespSerializer()
    _CUTOFF = 6000  # as redis-py: smaller commands are joined into one buffer, larger go alone

    def _pack(args: tuple[Any, ...]) -> bytes:
        name = args[0]
        if (isinstance(name, str) and " " in name) or (isinstance(name, bytes) and b" " in name):
            return b"".join(_SERIALIZER.pack(*args))  # "XINFO GROUPS": words sent apart
        try:
            packed: bytes = hiredis.pack_command(args)
        except TypeError:  # a bytearray (converted there) or a type no packer takes (DataError)
            return b"".join(_SERIALIZER.pack(*args))
        return packed

    class _HiredisPacking:
        """hiredis packing as redis-py's ``HiredisRespSerializer`` does it, without its
        per-argument conversion pass when no argument needs it, and a pipeline's commands
        joined into few buffers (one send) instead of packed one call each."""

        def pack_command(self, *args: Any) -> list[bytes]:
            return [_pack(args)]

        def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
            output: list[bytes] = []
            pieces: list[bytes] = []
            size = 0
            for cmd in commands:
                chunk = _pack(tuple(cmd))
                if len(chunk) > _CUTOFF:
                    if pieces:
                        output.append(b"".join(pieces))
                        pieces, size = [], 0
                    output.append(chunk)
                    continue
                pieces.append(chunk)
                size += len(chunk)
                if size > _CUTOFF:
                    output.append(b"".join(pieces))
                    pieces, size = [], 0
            if pieces:
                output.append(b"".join(pieces))
            return output

    class _TcpConnection(_HiredisPacking, Connection):
        pass

    class _SslConnection(_HiredisPacking, SSLConnection):
        pass

    class _UnixConnection(_HiredisPacking, UnixDomainSocketConnection):
        pass

    class _SentinelTcpConnection(_HiredisPacking, SentinelConnection):
        pass

    class _SentinelTlsConnection(_HiredisPacking, SentinelSslConnection):
        pass


class LeanConnectionPool(ConnectionPool):
    """redis-py's asyncio pool, its hand-out and take-back cut to what they must do: an idle
    connection is popped and marked in use, checked as redis-py checks it (connected, no
    unread data: ``ensure_connection``), and put back, disconnected first when it asks to be.
    A pool with no idle connection goes redis-py's own way (it makes one, within
    ``max_connections``). Nothing awaits between the pop and the mark, so in one event loop
    no other coroutine sees the connection in neither list."""

    async def get_connection(
        self, command_name: str | None = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        try:
            conn: AbstractConnection = self._available_connections.pop()
        except IndexError:
            return await super().get_connection()  # type: ignore[no-untyped-call,no-any-return]
        self._in_use_connections.add(conn)
        try:
            # redis-py's check, without its connect() of a connected connection (which goes
            # through the retry machinery to find it connected): a connection that is closed
            # or has unread data is handed to ensure_connection, which reconnects it.
            try:
                dirty = not conn.is_connected or await conn.can_read()
            except (RedisConnectionError, RedisTimeoutError, OSError):
                dirty = True
            if dirty:
                await self.ensure_connection(conn)
        except BaseException:
            await self.release(conn)
            raise
        return conn

    async def release(self, connection: AbstractConnection) -> None:
        self._in_use_connections.remove(connection)
        if connection.should_reconnect():  # type: ignore[no-untyped-call]
            await connection.disconnect()
        self._available_connections.append(connection)


def use_hiredis_packing(client: Redis) -> Redis:
    """Make ``client``'s new connections pack with hiredis (when installed); returns it.

    Call it before the client has opened a connection. The URL's scheme chose the connection
    class; its kind (TCP, TLS, Unix socket, Sentinel-managed over TCP or TLS) is kept.
    """
    if HIREDIS_AVAILABLE:
        pool = client.connection_pool
        for base, fast in (  # subclasses before their bases
            (SentinelSslConnection, _SentinelTlsConnection),
            (SentinelConnection, _SentinelTcpConnection),
            (UnixDomainSocketConnection, _UnixConnection),
            (SSLConnection, _SslConnection),
            (Connection, _TcpConnection),
        ):
            if issubclass(pool.connection_class, base):
                pool.connection_class = fast
                break
    return client


def async_client(
    settings: Settings,
    *,
    socket_timeout: float | None = None,
    health_check_interval: int = 30,
) -> Redis:
    """The asyncio client every dtq process uses for ``settings``' Redis (SDK, API, worker):
    decoded strings, hiredis packing, a 5 s connect timeout, no retries. With sentinels set,
    a client of the primary they name.

    With ``DTQ_REDIS_CLUSTER`` it is a :class:`redis.asyncio.RedisCluster` (typed as the
    :class:`Redis` whose commands it shares): its commands go to their slot's node, it follows
    MOVED/ASK and a failover inside the cluster, and :class:`dtq.scripts.Scripts` routes the
    script calls; the process takes the cluster key layout (:func:`dtq.keys.use_layout`).

    Raises ``ValueError`` for a URL redis-py cannot parse (the caller names the setting)."""
    keys.use_layout(settings.redis_cluster)
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
        "health_check_interval": health_check_interval,
        "retry": no_retry(),
    }
    if settings.redis_cluster:
        return cast(Redis, RedisCluster.from_url(settings.redis_url, **options))
    if settings.redis_sentinels:
        return use_hiredis_packing(primary_client(settings, options))
    pool = LeanConnectionPool.from_url(settings.redis_url, **options)
    return use_hiredis_packing(Redis.from_pool(pool))


_SHARDED_PUBSUB_SINCE = 7  # Redis 7.0; Valkey reports redis_version 7.2.4 (and has it)


async def choose_events(redis: Redis) -> None:
    """In the cluster layout, decide once per process (at connect) whether events go by
    sharded pub/sub: when the server has it (``redis_version`` 7.0 or later), a queue's events
    are SPUBLISHed to its shard channel (:func:`dtq.keys.events`). One node answers for the
    cluster, whose nodes run one version. A server that refuses INFO (renamed or disabled, as
    on some managed services) gets the classic channel, which every cluster delivers. Nothing
    to ask in the flat layout: ``dtq:events``."""
    if not keys.cluster_layout():
        return
    try:
        info = await redis.execute_command(  # type: ignore[no-untyped-call]
            "INFO", "server", target_nodes=RedisCluster.RANDOM
        )
    except ResponseError:
        info = {}
    major = str(info.get("redis_version", "0")).partition(".")[0]
    keys.use_sharded_events(major.isdigit() and int(major) >= _SHARDED_PUBSUB_SINCE)


def sync_client(settings: Settings, *, socket_timeout: float) -> sync_redis.Redis:
    """The blocking client of the worker's heartbeat thread (its own connection, so a busy
    event loop cannot starve it): decoded strings, redis-py's retries (its beat and touch
    are safe to send again). With sentinels set, a client of the primary they name; a
    :class:`redis.RedisCluster` with ``DTQ_REDIS_CLUSTER``."""
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
    }
    if settings.redis_cluster:
        return cast(
            sync_redis.Redis, sync_redis.RedisCluster.from_url(settings.redis_url, **options)
        )
    if settings.redis_sentinels:
        return primary_sync_client(settings, options)
    return sync_redis.Redis.from_url(settings.redis_url, **options)


async def warn_durability(redis: Redis, log: logging.Logger) -> None:
    """Log a warning when Redis may evict keys (``maxmemory-policy`` other than ``noeviction``)
    or lose acknowledged writes on a crash (AOF off): docs/delivery-guarantees.md.

    A server that refuses CONFIG GET (renamed or disabled, as on managed Redis) is not checked;
    a setting the reply leaves out counts as not set up (AOF off)."""
    try:
        policy = await redis.config_get("maxmemory-policy")
        aof = await redis.config_get("appendonly")
    except ResponseError:
        return
    if policy.get("maxmemory-policy", "noeviction") != "noeviction":
        log.warning(
            "Redis maxmemory-policy is %r, not 'noeviction': Redis may evict task data",
            policy.get("maxmemory-policy"),
        )
    if aof.get("appendonly") != "yes":
        log.warning("Redis AOF is off: a Redis crash loses the tasks written since the last save")
