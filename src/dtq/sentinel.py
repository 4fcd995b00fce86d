"""Clients of a Sentinel-managed primary (``DTQ_REDIS_SENTINELS``; docs/operations.md,
"Sentinel"), built by :func:`dtq.connection.async_client` and :func:`~dtq.connection.sync_client`
with the options they give every client (hiredis packing is added there).

They are redis-py's Sentinel-managed clients: each new connection asks the sentinels (the
first that answers) where the primary is. A connection that fails (the primary died) is
dropped by redis-py, and so is one whose write a replica refused (a demoted primary, which a
sentinel that has not yet seen the failover may still name): the next connection asks the
sentinels again and reaches the primary elected in its place. ``DTQ_REDIS_URL`` gives the
primary's user, password, db and TLS; its host and port are unused. The sentinels are reached
with ``DTQ_REDIS_SENTINEL_PASSWORD`` and, when the URL is ``rediss://``, over TLS with its
options.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import redis as sync_redis
import redis.sentinel as sync_sentinel
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, parse_url
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

if TYPE_CHECKING:
    from dtq.config import Settings

__all__ = ["SentinelConnection", "SentinelSslConnection", "primary_client", "primary_sync_client"]


def primary_client(settings: Settings, options: dict[str, Any]) -> Redis:
    """An asyncio client of the primary the sentinels name, its connections built with
    ``options`` (its retry policy applies to the sentinels too). Raises ``ValueError`` for a
    URL redis-py cannot parse."""
    primary, tls = _primary_options(settings.redis_url)
    retry = {"retry": options["retry"]} if "retry" in options else {}
    sentinels = _Sentinels(  # type: ignore[no-untyped-call]
        settings.sentinel_addresses, sentinel_kwargs=_sentinel_options(settings, tls, **retry)
    )
    connection_class = SentinelSslConnection if tls else SentinelConnection
    client: _PrimaryClient = sentinels.master_for(
        settings.redis_sentinel_master,
        redis_class=_PrimaryClient,
        **{**options, "connection_class": connection_class, **primary},
    )
    client.sentinels = sentinels
    return client


def primary_sync_client(settings: Settings, options: dict[str, Any]) -> sync_redis.Redis:
    """The blocking twin of :func:`primary_client` (the worker's heartbeat thread)."""
    primary, tls = _primary_options(settings.redis_url)
    sentinels = _SyncSentinels(  # type: ignore[no-untyped-call]
        settings.sentinel_addresses, sentinel_kwargs=_sentinel_options(settings, tls)
    )
    connection_class = _SyncSentinelSslConnection if tls else _SyncSentinelConnection
    client: _SyncPrimaryClient = sentinels.master_for(  # type: ignore[no-untyped-call]
        settings.redis_sentinel_master,
        redis_class=_SyncPrimaryClient,
        **{**options, "connection_class": connection_class, **primary},
    )
    client.sentinels = sentinels
    return client


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
    sentinel that does not answer is skipped for the next one."""
    options: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 5, **extra}
    if settings.redis_sentinel_password:
        options["password"] = settings.redis_sentinel_password
    if tls:
        options["ssl"] = True
        options.update(
            {k: v for k, v in parse_url(settings.redis_url).items() if k.startswith("ssl_")}
        )
    return options


# -- connections that leave a demoted primary ---------------------------------------------------

# A write refused because the server is a replica. redis-py tells a plain command's READONLY
# reply (ReadOnlyError) and its Sentinel connections drop the connection on it; inside a script,
# Redis 6.2 wraps it in the script's error ("... @user_script: 1: -READONLY You can't write
# against a read only replica."), which is told the same way here.
_DEMOTED = "-READONLY "


def _demoted(err: ResponseError) -> bool:
    return _DEMOTED in str(err)


class SentinelConnection(SentinelManagedConnection):
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


class SentinelSslConnection(SentinelConnection, SentinelManagedSSLConnection):
    pass


class _SyncSentinelConnection(sync_sentinel.SentinelManagedConnection):
    """The blocking twin of :class:`SentinelConnection`."""

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


# -- the sentinels and the clients that own them ------------------------------------------------

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


class _PrimaryClient(Redis):
    """A client of the Sentinel-managed primary; closing it closes its sentinels' clients."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinels is not None:
                await self.sentinels.aclose()


class _SyncPrimaryClient(sync_redis.Redis):
    """The blocking twin of :class:`_PrimaryClient`."""

    sentinels: sync_sentinel.Sentinel | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.sentinels is not None:
                self.sentinels.close()
