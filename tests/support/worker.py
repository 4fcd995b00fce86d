"""Worker helpers: fast settings, the one in-process worker (:func:`running_worker`, always
stopped), worker subprocesses (``python -m dtq.worker``) stopped by PID, a task module for
subprocesses written to a temporary folder, and waits on a task's or a worker's state."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.calls import (
    Entry,
    FinishReply,
    Outcome,
    StartReply,
    finish_call,
    finish_many,
    start_many,
)
from dtq.config import Settings
from dtq.models import TaskStatus
from dtq.scripts import Scripts
from dtq.store import Store
from dtq.worker import Worker
from dtq_tasks import Handler, RateLimited, TaskContext
from support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]

FAST: dict[str, Any] = {
    "heartbeat_interval_s": 0.2,
    "visibility_timeout_s": 1.5,
    "reaper_interval_s": 0.2,
    "scheduler_interval_s": 0.05,
    "drain_timeout_s": 5,
    "retry_base_delay": 0.05,
    "retry_max_delay": 0.4,
    "retry_jitter": 0.2,
}


def fast(settings: Settings, **overrides: Any) -> Settings:
    return settings.model_copy(update={**FAST, **overrides})


async def wait_status(
    r: Redis, task_id: str, *statuses: str, timeout_s: float = 10.0
) -> dict[str, str]:
    """Wait until the task hash has one of ``statuses``; returns the hash."""
    seen: dict[str, str] = {}

    async def check() -> bool:
        nonlocal seen
        seen = await r.hgetall(keys.task(task_id))
        return seen.get("status") in statuses

    try:
        await wait_until(check, timeout_s, f"task {task_id} {statuses}")
    except AssertionError:
        raise AssertionError(f"task {task_id} never reached {statuses}; last: {seen}") from None
    return seen


ENTRY_FIELDS = {
    "task_id",
    "queue",
    "task_type",
    "payload",
    "attempt",
    "max_attempts",
    "priority",
    "timeout_ms",
    "idempotency_key",
}
"""The fields of a task stream entry (contract section 2)."""

DLQ_FIELDS = ENTRY_FIELDS | {
    "failed_at_ms",
    "attempts_made",
    "last_error",
    "last_error_class",
    "retryable",
    "worker_id",
    "original_queue",
}
"""A dead-letter entry's fields: the entry's and the failure's (contract section 2)."""


async def read_as(r: Redis, consumer: str, queue: str = "default", priority: int = 5) -> Entry:
    """Deliver the next entry of a stream to ``consumer`` (as if that worker read it)."""
    stream = keys.stream(queue, priority)
    reply = await r.xreadgroup(keys.CONSUMER_GROUP, consumer, {stream: ">"}, count=1)
    (_, [(entry_id, fields)]) = reply[0]
    entry = Entry.parse(stream, entry_id, fields)
    assert entry is not None
    return entry


def backend(r: Redis, settings: Settings) -> Store:
    """What a script call of :mod:`dtq.calls` runs against: ``r``, fresh scripts, ``settings``."""
    return Store(r, Scripts(), settings)


async def start_as(r: Redis, entry: Entry, consumer: str, settings: Settings) -> StartReply:
    """start.lua for ``entry`` as ``consumer`` (the worker's call, outside a worker)."""
    [reply] = await start_many(backend(r, settings), [entry], consumer)
    assert not isinstance(reply, Exception), reply
    return reply


async def finish_as(
    r: Redis, entry: Entry, attempt: int, outcome: Outcome, consumer: str, settings: Settings
) -> FinishReply:
    """finish.lua for ``entry`` as ``consumer`` (the worker's call, outside a worker)."""
    call = finish_call(entry, attempt, outcome, consumer, settings)
    [reply] = await finish_many(backend(r, settings), [call])
    assert not isinstance(reply, Exception), reply
    return reply


async def past_deadline(queue: Queue, when: datetime | None) -> None:
    """Wait until the Redis clock has passed ``when``."""
    assert when is not None

    async def passed() -> bool:
        return await queue.now() > when

    await wait_until(passed, 5, "deadline passed")


async def stream_empty(r: Redis, stream: str) -> bool:
    pending = await r.xpending(stream, keys.CONSUMER_GROUP)
    return await r.xlen(stream) == 0 and pending["pending"] == 0


def pushed_back_once(push: RateLimited, *, then: Any = None) -> Callable[..., Any]:
    """A handler whose upstream pushes back the first run of each task (``raise push``), then
    returns ``then`` (None: the attempt it runs at)."""
    seen: set[str] = set()

    async def run(payload: dict[str, Any], ctx: TaskContext) -> Any:
        if ctx.task_id not in seen:
            seen.add(ctx.task_id)
            raise push
        return ctx.attempt if then is None else then

    return run


def handlers(**fns: Callable[..., Any]) -> dict[str, Handler]:
    return {name: Handler(name, fn) for name, fn in fns.items()}


@contextlib.asynccontextmanager
async def running_worker(
    settings: Settings,
    handler_map: Mapping[str, Handler] | None = None,
    *,
    queues: tuple[str, ...] = ("default",),
    concurrency: int = 4,
    worker_id: str | None = None,
    force_stop: bool = False,
) -> AsyncIterator[Worker]:
    """A :class:`Worker` in this event loop (handlers: ``handler_map``, else the registry of
    the imported task modules), run by :func:`started`."""
    worker = Worker(
        settings, queues=queues, concurrency=concurrency, handlers=handler_map, worker_id=worker_id
    )
    async with started(worker, force_stop=force_stop):
        yield worker


@contextlib.asynccontextmanager
async def started(worker: Worker, *, force_stop: bool = False) -> AsyncIterator[Worker]:
    """Run a built ``worker`` in this event loop for the block: its start awaited (what stopped
    it raised, if it stopped first), and always stopped at the end: drained, or with
    ``force_stop`` the drain skipped (tests that end their handlers themselves)."""
    run = asyncio.create_task(worker.run())
    starting = asyncio.create_task(worker.started.wait())
    await asyncio.wait({run, starting}, timeout=15, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
    try:
        if run.done():
            run.result()  # raises what stopped it
        assert worker.started.is_set(), "the worker did not start within 15 s"
        yield worker
    finally:
        worker.stop()
        if force_stop:
            worker.stop()
        await asyncio.wait_for(run, 30)


# -- subprocess workers -------------------------------------------------------------------------

SUBPROCESS_TASKS = '''
"""Task types for worker subprocesses in the tests; every execution is recorded in Redis."""
import asyncio
import os
import time

import redis

from dtq_tasks import TaskContext, task


def _redis():
    url = os.environ["DTQ_REDIS_URL"]
    if os.environ.get("DTQ_REDIS_CLUSTER", "").lower() in {"1", "true", "yes", "on"}:
        return redis.RedisCluster.from_url(url, decode_responses=True)
    return redis.Redis.from_url(url, decode_responses=True)


def _record(ctx: TaskContext, what: str) -> None:
    r = _redis()
    try:
        r.rpush(f"test:calls:{ctx.task_id}", f"{what}:{ctx.attempt}:{ctx.worker_id}")
    finally:
        r.close()


@task("sp_sleep")
async def sp_sleep(payload, ctx):
    """Sleep payload["s"] (or payload["by_attempt"][attempt - 1]) seconds, recording both ends."""
    _record(ctx, "start")
    by_attempt = payload.get("by_attempt")
    s = by_attempt[min(ctx.attempt, len(by_attempt)) - 1] if by_attempt else payload.get("s", 1)
    await asyncio.sleep(float(s))
    _record(ctx, "end")
    return {"attempt": ctx.attempt, "worker_id": ctx.worker_id}


def _seconds(payload, ctx):
    """payload["s"], or payload["by_attempt"] at this attempt (its last for later ones)."""
    by_attempt = payload.get("by_attempt")
    s = by_attempt[min(ctx.attempt, len(by_attempt)) - 1] if by_attempt else payload.get("s", 1)
    return float(s)


@task("sp_block")
def sp_block(payload, ctx):
    """A sync handler blocking its thread payload["s"] (or by_attempt) seconds."""
    _record(ctx, "start")
    time.sleep(_seconds(payload, ctx))
    _record(ctx, "end")
    return {"attempt": ctx.attempt}


@task("sp_hog")
async def sp_hog(payload, ctx):
    """An async handler that blocks the event loop payload["s"] (or by_attempt) seconds (a bug,
    on purpose)."""
    _record(ctx, "start")
    time.sleep(_seconds(payload, ctx))
    _record(ctx, "end")
    return {"attempt": ctx.attempt}


@task("sp_crash")
def sp_crash(payload, ctx):
    """Kill the worker process running it (no cleanup, like a segfault)."""
    _record(ctx, "start")
    os._exit(17)
'''


def write_task_module(folder: Path, name: str = "sp_tasks") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(SUBPROCESS_TASKS))
    return name


class WorkerProcess:
    """``python -m dtq.worker`` in a subprocess; stopped by PID, output kept in a log file.
    ``cluster``: ``redis_url`` is a Redis Cluster's (``DTQ_REDIS_CLUSTER=1``)."""

    def __init__(
        self,
        redis_url: str,
        folder: Path,
        *,
        worker_id: str | None = None,
        args: tuple[str, ...] = (),
        env: Mapping[str, Any] | None = None,
        tasks: str = "sp_tasks",
        cluster: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.log_path = folder / f"worker-{worker_id or 'x'}-{time.monotonic_ns()}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_")}
        full_env.update({f"DTQ_{k.upper()}": str(v) for k, v in FAST.items()})
        full_env["DTQ_REDIS_URL"] = redis_url
        if cluster:
            full_env["DTQ_REDIS_CLUSTER"] = "1"
        full_env["DTQ_LOG_LEVEL"] = "INFO"
        full_env["DTQ_WORKER_METRICS_PORT"] = "0"  # no endpoint on 0.0.0.0 in tests
        full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src")])
        if worker_id:
            full_env["DTQ_WORKER_ID"] = worker_id
        # settings by name (DRAIN_TIMEOUT_S=0.3 is DTQ_DRAIN_TIMEOUT_S), other variables as given
        full_env.update(
            {
                (k if k.startswith("DTQ_") or not k.isupper() else f"DTQ_{k}"): str(v)
                for k, v in (env or {}).items()
            }
        )
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dtq.worker", "--tasks", tasks, *args],
            cwd=folder,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signum)

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        """SIGCONT (in case it is stopped), SIGTERM, then SIGKILL after a deadline."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()


async def wait_worker_ready(r: Redis, worker_id: str, timeout_s: float = 20.0) -> None:
    async def ready() -> bool:
        return await r.hget(keys.worker(worker_id), "status") in {"ready", "busy"}

    await wait_until(ready, timeout_s, f"worker {worker_id} ready")


async def calls(r: Redis, task_id: str) -> list[str]:
    return list(await r.lrange(f"test:calls:{task_id}", 0, -1))


def terminal(h: Mapping[str, str]) -> bool:
    return h.get("status") in {
        s.value
        for s in (
            TaskStatus.SUCCEEDED,
            TaskStatus.FAILED,
            TaskStatus.DEAD_LETTERED,
            TaskStatus.CANCELLED,
            TaskStatus.EXPIRED,
        )
    }
