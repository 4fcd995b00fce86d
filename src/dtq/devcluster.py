"""A private Redis Cluster, formed with plain commands, for the test suite and the benchmarks.

:func:`start_cluster` starts ``primaries * (1 + replicas)`` server processes, the binary
:func:`dtq.devserver.find_redis_server` picks (redis-server 6.2 or valkey-server 8.1, by
``DTQ_REDIS_SERVER``), each on 127.0.0.1 on a free port (its cluster bus on port + 10000) with
its own data folder and ``nodes.conf``, and forms the cluster the way ``redis-cli --cluster
create`` would, without it:

1. ``CLUSTER ADDSLOTS`` on every primary (an even share of the 16384 slots, sent in chunks:
   6.2 has no ``ADDSLOTSRANGE``) and ``CLUSTER SET-CONFIG-EPOCH`` on every node (distinct
   epochs, so no collision has to be resolved);
2. ``CLUSTER MEET`` between every two nodes, then a wait until every node knows every other;
3. ``CLUSTER REPLICATE`` on every replica (``replicas`` per primary);
4. a wait, with a deadline, until every node reports ``cluster_state:ok``, every node's view of
   the 16384 slots and of who replicates whom is the same, and every replica is in sync.

Failover is made quick: ``cluster-node-timeout`` is short (``node_timeout_ms``), and
``cluster-replica-validity-factor 0`` lets a replica take over however long ago it last heard
from its primary. A failover takes about the node timeout plus one or two seconds
(docs/operations.md has the figures), and needs most primaries alive to vote: with fewer than
three primaries, a killed one is never replaced. Replicas sync diskless with no delay. The
data is not persisted (no RDB, no AOF) unless ``persistent`` asks for AOF.

Every process is stopped by PID: by :meth:`DevCluster.stop` (also on leaving its ``with``
block), and by :func:`start_cluster` itself when forming fails.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import redis

from dtq.devserver import RedisServer, find_redis_server, free_port, server_args, url_answers
from dtq.errors import ConfigError

__all__ = ["ClusterNode", "DevCluster", "start_cluster"]

CLUSTER_SLOTS = 16384
ADDSLOTS_CHUNK = 1024
BUS_PORT_OFFSET = 10000
"""The cluster bus listens on the client port + 10000 (redis-server 6.2 cannot be told
otherwise), so a node's port must leave room for it."""
START_ATTEMPTS = 3
"""A node that exits at start (its port taken between the choice and the bind) is started
again on other ports, this many times in all."""

Role = Literal["primary", "replica", "down"]


@dataclass(frozen=True)
class ClusterNode:
    """One node as it answered ``ROLE`` when asked: ``down`` once its process has gone;
    ``primary_port`` is a replica's primary."""

    port: int
    pid: int
    node_id: str
    role: Role
    primary_port: int | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class DevCluster:
    """The processes of a cluster :func:`start_cluster` formed, and what tests do with them."""

    def __init__(self, binary: str, node_timeout_ms: int) -> None:
        self.binary = binary
        self.node_timeout_ms = node_timeout_ms
        self._servers: dict[int, RedisServer] = {}
        """By port, in start order: the primaries first, then their replicas."""
        self._ids: dict[int, str] = {}
        self._clients: dict[int, redis.Redis] = {}

    # --- what tests read ------------------------------------------------------------------

    @property
    def nodes(self) -> list[ClusterNode]:
        """Every node, in start order, with the role each one reports now."""
        return [self._node(port) for port in self._servers]

    def primaries(self) -> list[ClusterNode]:
        return [node for node in self.nodes if node.role == "primary"]

    def replicas(self) -> list[ClusterNode]:
        return [node for node in self.nodes if node.role == "replica"]

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` of a live primary: what ``RedisCluster.from_url``
        takes to discover the rest."""
        for node in self.nodes:
            if node.role == "primary":
                return node.url
        raise ConfigError("no live primary in the cluster")

    def alive(self, port: int) -> bool:
        return self._servers[port].process.poll() is None

    # --- what tests do --------------------------------------------------------------------

    def flushall(self) -> None:
        """FLUSHALL on every live primary; replicas follow through replication."""
        for node in self.primaries():
            self._clients[node.port].flushall()

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (by PID) and reap it: the others see it fail after
        ``node_timeout_ms``, and a replica of a killed primary takes its slots over."""
        server = self._servers[port]
        server.process.kill()
        server.process.wait()
        self._clients[port].close()

    def wait_healthy(self, timeout_s: float = 30) -> None:
        """Wait until every live node says ``cluster_state:ok`` and agrees that every slot is
        served by a live primary (after a failover: the promoted replica), or TimeoutError.
        It blocks: from a running event loop, call it with ``asyncio.to_thread``."""
        _wait(self._health_problem, time.monotonic() + timeout_s, "the cluster was not healthy")

    def stop(self, timeout_s: float = 10) -> None:
        """Stop every process (SIGTERM, SIGKILL after ``timeout_s``), by PID."""
        for client in self._clients.values():
            client.close()
        running = [s.process for s in self._servers.values() if s.process.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- forming --------------------------------------------------------------------------

    def _start_nodes(self, dirs: list[Path], persistent: bool, deadline: float) -> None:
        """Start a node in each of ``dirs`` and wait until each answers PING; a node that
        exits at start is started again on other ports (:data:`START_ATTEMPTS`)."""
        servers = [_launch(self.binary, d, self.node_timeout_ms, persistent) for d in dirs]
        self._servers = {server.port: server for server in servers}
        attempts = [1] * len(servers)
        waiting = set(range(len(servers)))
        while waiting:
            for i in sorted(waiting):
                server = servers[i]
                if server.process.poll() is None:
                    if url_answers(f"redis://127.0.0.1:{server.port}/0", 0.2):
                        waiting.discard(i)
                    continue
                if attempts[i] == START_ATTEMPTS:
                    raise ConfigError(
                        f"{self.binary} exited at start (code {server.process.returncode}, "
                        f"port {server.port}): {_log_tail(server)}"
                    )
                attempts[i] += 1
                servers[i] = _launch(self.binary, dirs[i], self.node_timeout_ms, persistent)
                self._servers = {server.port: server for server in servers}
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.binary}: {len(waiting)} nodes did not answer in time")
            if waiting:
                time.sleep(0.02)
        for server in servers:
            self._clients[server.port] = redis.Redis(
                host="127.0.0.1",
                port=server.port,
                decode_responses=True,
                socket_timeout=2,
                socket_connect_timeout=1,
            )

    def _form(self, primaries: int, deadline: float) -> None:
        ports = list(self._servers)
        for port in ports:
            self._ids[port] = _command(self._clients[port], "CLUSTER", "MYID")
        for i, port in enumerate(ports[:primaries]):
            first, last = _share(i, primaries)
            for chunk in _chunks(range(first, last), ADDSLOTS_CHUNK):
                _command(self._clients[port], "CLUSTER", "ADDSLOTS", *chunk)
        for epoch, port in enumerate(ports, start=1):
            _command(self._clients[port], "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        # Every pair meets directly: no waiting for gossip to spread the news.
        for i, port in enumerate(ports):
            for other in ports[i + 1 :]:
                _command(self._clients[port], "CLUSTER", "MEET", "127.0.0.1", other)
        _wait(self._meet_problem, deadline, "the nodes did not all meet")
        for j, port in enumerate(ports[primaries:]):
            primary_id = self._ids[ports[j % primaries]]
            _command(self._clients[port], "CLUSTER", "REPLICATE", primary_id)
        _wait(self._formed_problem, deadline, "the cluster did not form")

    # --- conditions: each returns what is still wrong, or None ----------------------------

    def _meet_problem(self) -> str | None:
        for port, client in self._clients.items():
            views = _parse_nodes(_command(client, "CLUSTER", "NODES"))
            known = {v.node_id for v in views if not v.flags & {"handshake", "noaddr"}}
            if known != set(self._ids.values()):
                return f"port {port} knows {len(known)} of {len(self._ids)} nodes"
        return None

    def _formed_problem(self) -> str | None:
        problem = self._health_problem()
        if problem:
            return problem
        shapes = {}
        for port in self._live_ports():
            views = _parse_nodes(_command(self._clients[port], "CLUSTER", "NODES"))
            shapes[port] = {(v.node_id, v.role, v.primary_id) for v in views}
        if len({frozenset(shape) for shape in shapes.values()}) > 1:
            return "the nodes do not agree yet on who replicates whom"
        for node in self.nodes:
            if node.role == "replica":
                info = self._clients[node.port].info("replication")
                if info.get("master_link_status") != "up" or info.get("master_sync_in_progress"):
                    return f"replica {node.port} is not in sync with {node.primary_port}"
        return None

    def _health_problem(self) -> str | None:
        live = self._live_ports()
        live_ids = {self._ids[port]: port for port in live}
        maps: dict[int, tuple[str, ...]] = {}
        for port in live:
            client = self._clients[port]
            try:
                info = _parse_info(_command(client, "CLUSTER", "INFO"))
                views = _parse_nodes(_command(client, "CLUSTER", "NODES"))
            except (redis.RedisError, OSError) as exc:
                return f"port {port} did not answer ({exc})"
            if info.get("cluster_state") != "ok":
                return f"port {port} says cluster_state:{info.get('cluster_state')}"
            if info.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                return f"port {port} has {info.get('cluster_slots_ok')} slots ok"
            owners: list[str] = [""] * CLUSTER_SLOTS
            for view in views:
                for first, last in view.slots:
                    owners[first : last + 1] = [view.node_id] * (last + 1 - first)
            maps[port] = tuple(owners)
        if not maps:
            return "no node is alive"
        if len(set(maps.values())) > 1:
            return "the nodes do not agree yet on who serves which slot"
        for owner in set(next(iter(maps.values()))):
            owner_port = live_ids.get(owner)
            if owner_port is None:
                return f"node {owner[:8]} serves slots but is down"
            if self._node(owner_port).role != "primary":
                return f"port {owner_port} serves slots but is not a primary yet"
        return None

    def _live_ports(self) -> list[int]:
        return [port for port in self._servers if self.alive(port)]

    def _node(self, port: int) -> ClusterNode:
        pid = self._servers[port].pid
        node_id = self._ids.get(port, "")
        if not self.alive(port):
            return ClusterNode(port, pid, node_id, "down")
        role = _command(self._clients[port], "ROLE")
        if role[0] == "master":
            return ClusterNode(port, pid, node_id, "primary")
        return ClusterNode(port, pid, node_id, "replica", int(role[2]))


def start_cluster(
    base_dir: Path,
    *,
    primaries: int = 3,
    replicas: int = 1,
    node_timeout_ms: int = 2000,
    persistent: bool = False,
    binary: str | None = None,
    timeout_s: float = 30,
) -> DevCluster:
    """Start and form a cluster of ``primaries`` primaries with ``replicas`` replicas each,
    node ``i`` in ``base_dir/node-<i>`` (a fresh folder: a node's ``nodes.conf`` is started
    over, not its data), and return it once formed (module docstring). Raises
    ConfigError when a node will not start, TimeoutError when the cluster has not formed
    within ``timeout_s``; either way every process it started is stopped first."""
    if primaries < 1 or replicas < 0:
        raise ConfigError("a cluster needs at least one primary and no negative replicas")
    cluster = DevCluster(binary or find_redis_server(), node_timeout_ms)
    deadline = time.monotonic() + timeout_s
    dirs = [base_dir / f"node-{i}" for i in range(primaries * (1 + replicas))]
    try:
        cluster._start_nodes(dirs, persistent, deadline)
        cluster._form(primaries, deadline)
    except BaseException:
        cluster.stop(timeout_s=2)
        raise
    return cluster


def _launch(binary: str, data_dir: Path, node_timeout_ms: int, persistent: bool) -> RedisServer:
    """Start one cluster node (not waiting for it) on a port whose bus port is free too."""
    port = _cluster_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "nodes.conf").unlink(missing_ok=True)
    log_path = data_dir / "redis.log"
    args = [
        *server_args(binary, port, data_dir, persistent),
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(node_timeout_ms),
        "--cluster-replica-validity-factor", "0",
        "--repl-diskless-sync", "yes",
        "--repl-diskless-sync-delay", "0",
    ]  # fmt: skip
    # Own session, like devserver's: a terminal's Ctrl-C must not reach it; stopped by PID.
    proc = subprocess.Popen(  # noqa: S603
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    return RedisServer(proc, port, data_dir, log_path)


def _cluster_port() -> int:
    """A free port whose bus port (+10000, at most 65535) is free as well."""
    while True:
        port = free_port()
        if port + BUS_PORT_OFFSET > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + BUS_PORT_OFFSET))
            except OSError:
                continue
        return port


def _command(client: redis.Redis, *args: str | int) -> Any:
    """One command, its reply as the server sent it (no redis-py parsing of CLUSTER NODES)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _log_tail(server: RedisServer) -> str:
    path = server.log_path
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def _wait(problem: Callable[[], str | None], deadline: float, what: str) -> None:
    """Poll ``problem`` until it finds none; past ``deadline``, TimeoutError naming the last
    problem found."""
    started = time.monotonic()
    while True:
        try:
            found = problem()
        except (redis.RedisError, OSError) as exc:
            found = f"a node did not answer ({exc})"
        if found is None:
            return
        if time.monotonic() > deadline:
            waited = time.monotonic() - started
            raise TimeoutError(f"{what} within {waited:.1f}s: {found}")
        time.sleep(0.05)


def _share(i: int, count: int) -> tuple[int, int]:
    """The slots ``[first, last)`` of primary ``i`` of ``count``: an even split."""
    return i * CLUSTER_SLOTS // count, (i + 1) * CLUSTER_SLOTS // count


def _chunks(values: range, size: int) -> Iterable[range]:
    return (values[i : i + size] for i in range(0, len(values), size))


@dataclass(frozen=True)
class _View:
    """One line of ``CLUSTER NODES``: a node as the answering node sees it."""

    node_id: str
    flags: frozenset[str]
    primary_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def role(self) -> str:
        return "primary" if "master" in self.flags else "replica"


def _parse_nodes(text: str) -> list[_View]:
    views = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        slots = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being migrated or imported
                continue
            first, _, last = item.partition("-")
            slots.append((int(first), int(last or first)))
        primary = None if fields[3] == "-" else fields[3]
        views.append(_View(fields[0], frozenset(fields[2].split(",")), primary, tuple(slots)))
    return views


def _parse_info(text: str) -> dict[str, str]:
    pairs = (line.partition(":") for line in text.splitlines() if ":" in line)
    return {key: value.strip() for key, _, value in pairs}
