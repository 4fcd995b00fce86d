"""Long-running commands: ``dtq worker run``, ``dtq api`` and ``dtq dev`` (DESIGN 8, 9).

``dtq dev`` is a small supervisor: a private redis-server (data under ``.dtq/redis``) unless
DTQ_REDIS_URL is set and answers, the API and one worker with the demo tasks, each a child
process in its own session so a terminal's Ctrl-C reaches only this supervisor, which then stops
them in order by PID: the worker first (it drains its in-flight tasks), then the API, then
Redis. A child that dies on its own brings the others down the same way (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import FrameType

from dtq import devserver
from dtq.config import Settings, describe_redis, redact_url
from dtq.errors import DtqError
from dtq_cli.output import Output

__all__ = ["DevStack", "api", "dev", "worker_run"]

DEV_DATA_DIR = Path(".dtq") / "redis"
API_START_TIMEOUT_S = 30.0
API_STOP_TIMEOUT_S = 15.0
POLL_S = 0.1


def worker_run(args: argparse.Namespace, settings: Settings, out: Output) -> int:
    """Blocking: the worker's own exit code (0 after a clean drain)."""
    from dtq.worker import run_worker  # only this command needs the worker runtime

    return run_worker(
        settings,
        queues=args.queues,
        concurrency=args.concurrency,
        task_modules=args.task_modules,
        processes=args.processes,
    )


def api(args: argparse.Namespace, settings: Settings, out: Output) -> int:
    """Blocking: uvicorn serving the app until Ctrl-C or SIGTERM."""
    # Loaded by name, at run time: only this command brings in the web framework; every other
    # dtq command starts without it (the import-linter contract keeps dtq_cli free of fastapi).
    app_module = importlib.import_module("dtq.api")
    app_module.serve(settings, args.host or settings.api_host, args.port or settings.api_port)
    return 0


# -- dtq dev -------------------------------------------------------------------------------------


class _Stop(Exception):
    """Raised by the signal handler to leave the supervisor's wait."""


class DevStack:
    """The three processes of ``dtq dev`` and their ordered shutdown."""

    def __init__(self, settings: Settings, host: str, port: int, out: Output) -> None:
        self.settings = settings
        self.host = host
        self.port = port
        self.out = out
        self.redis: devserver.RedisServer | None = None
        self.redis_url = settings.redis_url
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._check_port(self.host, self.port, "the API", "--port")
        self._start_redis()
        env = {**os.environ, "DTQ_REDIS_URL": self.redis_url}
        self.children["api"] = self._spawn(
            ["api", "--host", self.host, "--port", str(self.port)], env
        )
        # Task modules from DTQ_TASK_MODULES (default: the demo tasks, examples.tasks), the
        # same ones the API loads to validate task types.
        self.children["worker"] = self._spawn(["worker", "run"], env)
        self._wait_api()

    def _start_redis(self) -> None:
        """The Redis at DTQ_REDIS_URL (or its default) if it answers; else a private one, on
        that URL's port when it is a free local port, so ``dtq`` commands in another terminal
        reach it with the same settings."""
        url = self.settings.redis_url
        if self.settings.redis_sentinels or self.settings.redis_cluster:
            # A configured topology is used as it is: a private single Redis would not be it.
            self.out.note(f"dtq dev: using {describe_redis(self.settings)}")
            return
        if devserver.url_answers(url):
            self.out.note(f"dtq dev: using the Redis that answers at {redact_url(url)}")
            return
        port = _local_port(url)
        if port is not None and not _port_free(port):
            port = None
        # Absolute: redis-server changes into --dir before it opens its log file.
        self.redis = devserver.start_redis(DEV_DATA_DIR.resolve(), port=port, persistent=True)
        self.redis_url = url if port is not None else self.redis.url
        self.out.note(
            f"dtq dev: no Redis answers at {redact_url(url)}; started a private one at "
            f"{self.redis_url} (data in {DEV_DATA_DIR})"
        )
        if port is None:
            self.out.note(
                f"dtq dev: for dtq commands in another terminal: "
                f"export DTQ_REDIS_URL={self.redis_url}"
            )

    @staticmethod
    def _check_port(host: str, port: int, what: str, flag: str) -> None:
        if not _port_free(port, host):
            raise DtqError(
                f"cannot serve {what} on {host}:{port}: the port is in use; "
                f"choose another with {flag}"
            )

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # Own session: a terminal's Ctrl-C goes to the supervisor alone, which stops the
        # children in order instead of all at once.
        return subprocess.Popen(  # noqa: S603 - our own interpreter and module, fixed arguments
            [sys.executable, "-m", "dtq_cli", *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host  # noqa: S104
        return f"http://{host}:{self.port}"

    def _wait_api(self) -> None:
        deadline = time.monotonic() + API_START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_children()
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=1) as resp:  # noqa: S310
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL_S)
        raise DtqError(f"the API did not answer on {self.base_url}/health within "
                       f"{API_START_TIMEOUT_S:.0f}s")  # fmt: skip

    def _check_children(self) -> None:
        for name, proc in self.children.items():
            code = proc.poll()
            if code is not None:
                raise DtqError(f"the {name} process exited with code {code}")

    def urls_line(self) -> str:
        base = self.base_url
        ws = "ws" + base.removeprefix("http") + self.settings.ws_path
        return (
            f"dtq dev: API {base}/api/v1  docs {base}/docs  metrics {base}/metrics  "
            f"events {ws}  redis {self.redis_url}  (Ctrl-C stops all)"
        )

    # -- run and stop ---------------------------------------------------------------------------

    def supervise(self) -> None:
        """Block until a signal (raises _Stop) or a child exits (raises DtqError)."""
        while True:
            self._check_children()
            time.sleep(POLL_S)

    def stop(self) -> list[str]:
        """Worker first (drains), then the API, then Redis; each by PID. Returns what stopped."""
        stopped = []
        drain_s = self.settings.drain_timeout_s + 10
        for name, timeout_s in (("worker", drain_s), ("api", API_STOP_TIMEOUT_S)):
            proc = self.children.get(name)
            if proc is not None:
                _terminate(proc, timeout_s)
                stopped.append(name)
        if self.redis is not None:
            self.redis.stop()
            stopped.append("redis")
        return stopped


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server can listen on the port. SO_REUSEADDR as uvicorn and redis-server set
    it: connections of a stopped server still in TIME_WAIT do not make the port busy."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _local_port(url: str) -> int | None:
    """The port of a ``redis://`` URL on this machine without credentials, else None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "redis" or parts.username or parts.password:
        return None
    if parts.hostname not in ("localhost", "127.0.0.1"):
        return None
    try:
        return parts.port or 6379
    except ValueError:
        return None


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def dev(args: argparse.Namespace, settings: Settings, out: Output) -> int:
    stack = DevStack(settings, args.host, args.port or settings.api_port, out)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Shutdown itself ignores further signals: it is bounded by its own timeouts.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Stop

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        stack.start()
        out.line(stack.urls_line())
        sys.stdout.flush()
        stack.supervise()
    except _Stop:
        out.note("dtq dev: stopping the worker (it drains), then the API, then Redis")
    except DtqError as exc:
        out.error(exc.message)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopped = stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    out.note(f"dtq dev: stopped {', '.join(stopped) or 'nothing'}")
    return code
