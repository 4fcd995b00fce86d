"""The chaos harness: real processes on 127.0.0.1 and the tools to hurt them.

- :class:`Cluster`: a private redis-server (``dtq.devserver.start_redis``), worker subprocesses
  (``python -m dtq.worker`` or ``chaos_worker.py``), the API under uvicorn; every process is
  started in its own session, logged to a file and stopped by PID in :meth:`Cluster.close`.
- :class:`EventLog`: a thread subscribed to ``dtq:events`` for the whole run (it reconnects
  after a Redis restart or a killed connection).
- :func:`running` and :func:`supervise`: one scenario's cluster with its event log, and a
  process manager that restarts the workers a scenario kills.

The load and its bookkeeping are in :mod:`chaos_load`.

Timeouts are the scaled-down settings of :data:`SETTINGS` (visibility 2 s, heartbeat 0.5 s,
scheduler tick 0.2 s, reaper 0.5 s); every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis as sync_redis
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq import keys
from dtq.config import Settings
from dtq.devserver import RedisServer, free_port, start_redis
from support import wait_until, wait_until_sync

CHAOS_DIR = Path(__file__).resolve().parent
REPO = CHAOS_DIR.parents[1]

# The scaled-down timeouts of every scenario (production defaults stay untouched).
SETTINGS: dict[str, str] = {
    "VISIBILITY_TIMEOUT_S": "2",
    "HEARTBEAT_INTERVAL_S": "0.5",
    "SCHEDULER_INTERVAL_S": "0.2",
    "REAPER_INTERVAL_S": "0.5",
    "CLAIM_STALE_S": "5",
    "DRAIN_TIMEOUT_S": "2",
    "RETRY_BASE_DELAY": "0.1",
    "RETRY_MAX_DELAY": "0.5",
    "RETRY_JITTER": "0.2",
    "WORKER_CONCURRENCY": "8",
    "WORKER_METRICS_PORT": "0",
    "MAX_QUEUE_DEPTH": "100000",
    "TASK_MODULES": "chaos_tasks",
    "LOG_LEVEL": "INFO",
}
VISIBILITY_S = float(SETTINGS["VISIBILITY_TIMEOUT_S"])
REAPER_S = float(SETTINGS["REAPER_INTERVAL_S"])
TERMINAL = frozenset({"succeeded", "failed", "dead_lettered", "cancelled", "expired"})


def settings_for(url: str, **overrides: Any) -> Settings:
    """The harness's own settings (for its SDK clients), from :data:`SETTINGS`."""
    values: dict[str, Any] = {k.lower(): v for k, v in SETTINGS.items()}
    values.update(overrides)
    return Settings(redis_url=url, **values)


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_REALTIME)


# -- processes ----------------------------------------------------------------------------------


class Proc:
    """One subprocess in its own session, output in a log file, stopped by PID."""

    def __init__(
        self, name: str, cmd: Sequence[str], env: Mapping[str, str], log_dir: Path, **popen: Any
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            list(cmd),
            cwd=CHAOS_DIR,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **popen,
        )
        self.started_ns = now_ns()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 10) -> None:
        """SIGCONT (it may be stopped), SIGTERM, SIGKILL after ``timeout_s``."""
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill9()
        self._log.close()


@dataclass
class WorkerProc:
    worker_id: str
    proc: Proc

    @property
    def pid(self) -> int:
        return self.proc.pid


class Cluster:
    """Redis, workers and (optionally) the API of one scenario, all under ``root``."""

    def __init__(self, root: Path, *, settings: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.exec_dir = root / "exec"
        self.log_dir = root / "logs"
        self.redis_dir = root / "redis"
        for d in (self.exec_dir, self.log_dir, self.redis_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.settings = {**SETTINGS, **(settings or {})}
        self.port = free_port()
        self.redis: RedisServer | None = None
        self.workers: list[WorkerProc] = []
        self.retired: list[WorkerProc] = []  # killed or stopped workers, kept for their logs
        self.api: Proc | None = None
        self.api_port = 0
        self._procs: list[Proc] = []
        self._serial = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- redis --------------------------------------------------------------------------------

    def start_redis(self, *, persistent: bool = False, fsync: str = "everysec") -> None:
        self.redis = start_redis(self.redis_dir, port=self.port, persistent=persistent)
        if persistent:
            client = sync_redis.Redis.from_url(self.url)
            try:
                # A restarted server answers PING while it still loads its AOF, and refuses
                # CONFIG SET until it is done (a busy machine makes the load take long).
                wait_until_sync(
                    lambda: client.info("persistence").get("loading") == 0,
                    30,
                    "Redis done loading its data",
                )
                client.config_set("appendfsync", fsync)
            finally:
                client.close()

    def redis_client(self) -> Redis:
        """The harness's own client: it retries through a Redis restart (dtq's clients do not,
        their loops retry)."""
        return Redis.from_url(
            self.url,
            decode_responses=True,
            socket_timeout=10,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 20),
            retry_on_error=[RedisConnectionError, RedisTimeoutError, OSError],
        )

    def kill_redis(self) -> None:
        assert self.redis is not None
        self.redis.process.kill()
        self.redis.process.wait(10)

    def shutdown_redis(self) -> None:
        """SHUTDOWN (Redis saves/fsyncs what its persistence asks for, then exits)."""
        assert self.redis is not None
        client = sync_redis.Redis.from_url(self.url)
        with contextlib.suppress(sync_redis.ConnectionError):
            client.shutdown()
        client.close()
        self.redis.process.wait(10)

    # -- workers and API ----------------------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTQ_", "CHAOS_"))}
        env.update({f"DTQ_{k}": v for k, v in self.settings.items()})
        env["DTQ_REDIS_URL"] = self.url
        env["CHAOS_LOG_DIR"] = str(self.exec_dir)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra or {})
        return env

    def spawn_worker(
        self,
        slot: str = "w",
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        entry: str = "dtq",
        **popen: Any,
    ) -> WorkerProc:
        """``entry``: ``dtq`` (python -m dtq.worker) or ``chaos`` (chaos_worker.py)."""
        self._serial += 1
        worker_id = f"{slot}-{self._serial}"
        cmd = (
            [sys.executable, "-m", "dtq.worker"]
            if entry == "dtq"
            else [sys.executable, str(CHAOS_DIR / "chaos_worker.py")]
        )
        proc = Proc(
            worker_id,
            [*cmd, "--tasks", "chaos_tasks", *args],
            self.env({"DTQ_WORKER_ID": worker_id, **(env or {})}),
            self.log_dir,
            **popen,
        )
        self._procs.append(proc)
        w = WorkerProc(worker_id, proc)
        self.workers.append(w)
        return w

    def retire(self, w: WorkerProc) -> None:
        if w in self.workers:
            self.workers.remove(w)
            self.retired.append(w)

    def spawn_api(self, extra_env: Mapping[str, str] | None = None) -> Proc:
        self.api_port = self.api_port or free_port()
        self._serial += 1
        cmd = [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "dtq.api:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.api_port),
            "--no-access-log",
        ]
        proc = Proc(f"api-{self._serial}", cmd, self.env(extra_env), self.log_dir)
        self._procs.append(proc)
        self.api = proc
        return proc

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    async def wait_api(self, timeout_s: float = 30) -> None:
        assert self.api is not None
        api = self.api

        async def healthy() -> bool:
            assert api.alive(), f"the API exited: {api.output()[-2000:]}"
            try:
                async with httpx.AsyncClient(timeout=1) as client:
                    return (await client.get(f"{self.api_base}/health")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_until(healthy, timeout_s, "API healthy", every_s=0.1)

    async def wait_workers(self, workers: Iterable[WorkerProc], timeout_s: float = 40) -> None:
        todo = list(workers)
        r = self.redis_client()
        try:

            async def ready() -> bool:
                for w in todo:
                    assert w.proc.alive(), f"{w.worker_id} exited: {w.proc.output()[-2000:]}"
                pipe = r.pipeline(transaction=False)
                for w in todo:
                    pipe.hget(keys.worker(w.worker_id), "status")
                states = await pipe.execute()
                return all(s in {"ready", "busy"} for s in states)

            await wait_until(ready, timeout_s, "workers ready", every_s=0.1)
        finally:
            await r.aclose()

    def close(self) -> None:
        """Stop every process this cluster started (newest first), then Redis."""
        for proc in reversed(self._procs):
            with contextlib.suppress(Exception):
                proc.stop()
        if self.redis is not None:
            self.redis.stop()

    def logs(self) -> dict[str, str]:
        return {p.name: p.output() for p in self._procs}


# -- events -------------------------------------------------------------------------------------


def _readonly(conn: Any) -> None:
    conn.on_connect()
    conn.send_command("READONLY")
    conn.read_response()


class EventLog:
    """Every message on ``dtq:events`` while open, with its local receive time (ns); and, given
    ``shards`` ((node URL, shard channels) pairs: a cluster whose events are sharded), every
    message of those channels, each set SSUBSCRIBEd on its node by a thread of its own."""

    def __init__(self, url: str, shards: Sequence[tuple[str, Sequence[str]]] = ()) -> None:
        self.url = url
        self.raw: list[tuple[int, str]] = []
        self.disconnects = 0
        self._stop = threading.Event()
        self._subscribed = [threading.Event() for _ in range(1 + len(shards))]
        self._threads = [
            threading.Thread(
                target=self._run, args=(url, (), self._subscribed[0]), name="chaos-events"
            ),
            *(
                threading.Thread(
                    target=self._run,
                    args=(node_url, tuple(channels), self._subscribed[i + 1]),
                    name=f"chaos-events-shard{i}",
                )
                for i, (node_url, channels) in enumerate(shards)
            ),
        ]
        for t in self._threads:
            t.daemon = True

    def __enter__(self) -> EventLog:
        for t in self._threads:
            t.start()
        for done in self._subscribed:
            if not done.wait(10):
                raise AssertionError("could not subscribe to the events channel")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _run(self, url: str, shard_channels: tuple[str, ...], subscribed: threading.Event) -> None:
        while not self._stop.is_set():
            client = sync_redis.Redis.from_url(
                url,
                socket_timeout=2,
                socket_connect_timeout=1,
                # A replica serves SSUBSCRIBE in READONLY mode only (else MOVED to its primary).
                **({"redis_connect_func": _readonly} if shard_channels else {}),
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                for channel in shard_channels:  # one by one: an SSUBSCRIBE names one slot
                    pubsub.ssubscribe(channel)
                if not shard_channels:
                    pubsub.subscribe(keys.EVENTS)
                while not self._stop.is_set():
                    msg = (
                        pubsub.get_sharded_message(timeout=0.5)
                        if shard_channels
                        else (pubsub.get_message(timeout=0.5))
                    )
                    if pubsub.subscribed:
                        subscribed.set()
                    if msg is not None and msg["type"] in ("message", "smessage"):
                        self.raw.append((now_ns(), msg["data"].decode()))
            except (sync_redis.RedisError, OSError):
                self.disconnects += 1
                self._stop.wait(0.1)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()
                    client.close()

    def events(self) -> list[dict[str, Any]]:
        out = []
        for recv_ns, raw in list(self.raw):
            ev = json.loads(raw)
            ev["_recv_ns"] = recv_ns
            out.append(ev)
        return out


# -- one scenario's run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """Reduced (``make test``) or full (``make chaos``, ``DTQ_CHAOS_FULL=1``) sizes; every
    random choice of a scenario comes from :meth:`rng`, seeded by the run's seed."""

    full: bool
    seed: int

    def pick(self, reduced: int, full: int) -> int:
        return full if self.full else reduced

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}")


@dataclass
class Run:
    cluster: Cluster
    events: EventLog
    r: Redis

    async def settle(self, seconds: float) -> None:
        """Let the workers run on after quiescence: a late execution would show up now."""
        await asyncio.sleep(seconds)


@contextlib.asynccontextmanager
async def running(
    root: Path,
    name: str,
    *,
    settings: Mapping[str, str] | None = None,
    persistent: bool = False,
    fsync: str = "everysec",
) -> AsyncIterator[Run]:
    """A cluster with Redis started and the event log open; everything stopped at the end."""
    cluster = Cluster(root / name, settings=settings)
    try:
        cluster.start_redis(persistent=persistent, fsync=fsync)
        with EventLog(cluster.url) as events:
            r = cluster.redis_client()
            try:
                yield Run(cluster, events, r)
            finally:
                await r.aclose()
    finally:
        cluster.close()


async def supervise(
    cluster: Cluster,
    stop: asyncio.Event,
    respawn: Callable[[WorkerProc], WorkerProc],
    deaths: list[WorkerProc],
) -> None:
    """Restart every worker that died (like a process manager would) until ``stop``."""
    while not stop.is_set():
        for w in list(cluster.workers):
            if not w.proc.alive():
                cluster.retire(w)
                deaths.append(w)
                respawn(w)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
