"""Redis clients that pack commands with hiredis and never retry, and the start-up check of
Redis's durability settings that the API and the worker share.

redis-py's asyncio client packs every command in pure Python, per argument; a script call
carries 20 to 40 arguments, so packing costs more client CPU than anything else dtq does per
call. Where hiredis is installed (dtq depends on ``redis[hiredis]``) :func:`use_hiredis_packing`
makes a client's connections pack with it, as redis-py's sync client already does. The wire
format is the same. Used by the SDK (:func:`dtq.client.connect`, so the API too) and the worker.

With ``DTQ_REDIS_SENTINELS`` set, both factories return a client of the primary that the
sentinels name (redis-py's Sentinel-managed pool): each new connection asks the sentinels
where the primary is, and a connection to a primary that died or was demoted to a replica is
dropped, so the next command reaches the one elected in its place (docs/operations.md,
"Sentinel").

A retried command may already have run, and dtq's scripts are not replay-safe (a submit or a
start run twice). Every client dtq builds is given :func:`no_retry`, not left to redis-py's
default (none for ``from_url``, ten for ``Redis(host=...)``); :class:`dtq.scripts.Scripts`
never re-sends a script call, whatever client it is handed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import redis as sync_redis
import redis.sentinel as sync_sentinel
from redis.asyncio import Redis
from redis.asyncio.connection import (
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

if TYPE_CHECKING:
    from dtq.config import Settings

__all__ = [
    "HIREDIS_AVAILABLE",
    "async_client",
    "no_retry",
    "sync_client",
    "use_hiredis_packing",
    "warn_durability",
]


def no_retry() -> Retry:
    """The retry policy of every dtq client: a failed command is raised, never sent again."""
    return Retry(NoBackoff(), 0)


# A write refused because the server is a replica. redis-py tells a plain command's READONLY
# reply (ReadOnlyError) and its Sentinel connections drop the connection on it; inside a script,
# Redis 6.2 wraps it in the script's error ("... @user_script: 1: -READONLY You can't write
# against a read only replica."), which is told the same way here.
_DEMOTED = "-READONLY "


def _demoted(err: ResponseError) -> bool:
    return _DEMOTED in str(err)


class _SentinelConnection(SentinelManagedConnection):
    """A connection to the Sentinel-managed primary that also drops itself when a script's
    write was refused by a demoted primary, as redis-py does for a plain command."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as err:
            if not _demoted(err):
                raise
            await self.disconnect()  # the next connect asks the sentinels again
            raise RedisConnectionError("the primary was demoted to a replica") from err


class _SentinelSslConnection(_SentinelConnection, SentinelManagedSSLConnection):
    pass


class _SyncSentinelConnection(sync_sentinel.SentinelManagedConnection):
    """The blocking twin of :class:`_SentinelConnection` (the heartbeat thread's)."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except ResponseError as err:
            if not _demoted(err):
                raise
            self.disconnect()  # type: ignore[no-untyped-call]
            raise RedisConnectionError("the primary was demoted to a replica") from err


class _SyncSentinelSslConnection(
    _SyncSentinelConnection, sync_sentinel.SentinelManagedSSLConnection
):
    pass


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

    class _SentinelTcpConnection(_HiredisPacking, _SentinelConnection):
        pass

    class _SentinelTlsConnection(_HiredisPacking, _SentinelSslConnection):
        pass


def use_hiredis_packing(client: Redis) -> Redis:
    """Make ``client``'s new connections pack with hiredis (when installed); returns it.

    Call it before the client has opened a connection. The URL's scheme chose the connection
    class; its kind (TCP, TLS, Unix socket, Sentinel-managed over TCP or TLS) is kept.
    """
    if HIREDIS_AVAILABLE:
        pool = client.connection_pool
        for base, fast in (  # subclasses before their bases
            (_SentinelSslConnection, _SentinelTlsConnection),
            (_SentinelConnection, _SentinelTcpConnection),
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

    Raises ``ValueError`` for a URL redis-py cannot parse (the caller names the setting)."""
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
        "health_check_interval": health_check_interval,
        "retry": no_retry(),
    }
    if not settings.redis_sentinels:
        return use_hiredis_packing(Redis.from_url(settings.redis_url, **options))
    primary, tls = _primary_options(settings.redis_url)
    sentinel = _Sentinels(  # type: ignore[no-untyped-call]
        settings.sentinel_addresses,
        sentinel_kwargs=_sentinel_options(settings, tls, retry=no_retry()),
    )
    options["connection_class"] = _SentinelSslConnection if tls else _SentinelConnection
    client = sentinel.master_for(
        settings.redis_sentinel_master, redis_class=_SentinelRedis, **{**options, **primary}
    )
    client.sentinels = sentinel
    return use_hiredis_packing(client)


# redis-py's "No master found" names every sentinel by its client's repr (a few hundred
# characters each), then " - " and what it answered: only the answers are kept.
_SENTINEL_ANSWER = re.compile(r" - ([^,]+)")


def _no_primary(exc: RedisConnectionError, name: str) -> RedisConnectionError:
    """``exc`` (asyncio's or the blocking MasterNotFoundError) as one short line."""
    answers = ", ".join(_SENTINEL_ANSWER.findall(str(exc)))
    why = f" (sentinels answered: {answers})" if answers else ""
    return type(exc)(f"no sentinel names a primary {name!r} that is up{why}")


class _Sentinels(Sentinel):
    """redis-py's Sentinel manager with a one-line "no primary" error."""

    async def discover_master(self, service_name: str) -> Any:
        try:
            return await super().discover_master(service_name)
        except MasterNotFoundError as exc:
            raise _no_primary(exc, service_name) from None


class _SyncSentinels(sync_sentinel.Sentinel):
    """The blocking twin of :class:`_Sentinels`."""

    def discover_master(self, service_name: str) -> Any:
        try:
            return super().discover_master(service_name)  # type: ignore[no-untyped-call]
        except sync_sentinel.MasterNotFoundError as exc:
            raise _no_primary(exc, service_name) from None


class _SentinelRedis(Redis):
    """A client of the Sentinel-managed primary; closing it closes its sentinels' clients."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinels is not None:
                await self.sentinels.aclose()


def sync_client(settings: Settings, *, socket_timeout: float) -> sync_redis.Redis:
    """The blocking client of the worker's heartbeat thread (its own connection, so a busy
    event loop cannot starve it): decoded strings, redis-py's retries (its beat and touch
    are safe to send again). With sentinels set, a client of the primary they name."""
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
    }
    if not settings.redis_sentinels:
        return sync_redis.Redis.from_url(settings.redis_url, **options)
    primary, tls = _primary_options(settings.redis_url)
    sentinel = _SyncSentinels(  # type: ignore[no-untyped-call]
        settings.sentinel_addresses, sentinel_kwargs=_sentinel_options(settings, tls)
    )
    options["connection_class"] = _SyncSentinelSslConnection if tls else _SyncSentinelConnection
    client: _SyncSentinelRedis = sentinel.master_for(  # type: ignore[no-untyped-call]
        settings.redis_sentinel_master, redis_class=_SyncSentinelRedis, **{**options, **primary}
    )
    client.sentinels = sentinel
    return client


class _SyncSentinelRedis(sync_redis.Redis):
    """The blocking twin of :class:`_SentinelRedis`."""

    sentinels: sync_sentinel.Sentinel | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.sentinels is not None:
                self.sentinels.close()


def _primary_options(url: str) -> tuple[dict[str, Any], bool]:
    """What ``DTQ_REDIS_URL`` says about the primary besides its address (the sentinels give
    that): user, password, db, TLS options and any query options; and whether it is TLS
    (``rediss://``). Raises ``ValueError`` for a URL redis-py cannot parse."""
    options: dict[str, Any] = dict(parse_url(url))
    options.pop("host", None)
    options.pop("port", None)
    tls = issubclass(options.pop("connection_class", Connection), SSLConnection)
    return options, tls


def _sentinel_options(settings: Settings, tls: bool, **extra: Any) -> dict[str, Any]:
    """How the sentinels themselves are reached: ``DTQ_REDIS_SENTINEL_PASSWORD``, TLS (with
    the URL's TLS options) when the primary's URL is ``rediss://``, bounded timeouts. A
    sentinel that does not answer is skipped for the next one, so none is retried."""
    options: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 5, **extra}
    if settings.redis_sentinel_password:
        options["password"] = settings.redis_sentinel_password
    if tls:
        options["ssl"] = True
        options.update(
            {k: v for k, v in parse_url(settings.redis_url).items() if k.startswith("ssl_")}
        )
    return options


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
