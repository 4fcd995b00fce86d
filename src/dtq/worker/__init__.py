"""The dtq worker: ``run_worker`` (what ``dtq worker run`` calls, and ``python -m dtq.worker``
through it) and :class:`Worker`, the engine.

One task's path, file by file; each step calls only the next ones, and every script goes
through :mod:`dtq.calls`:

1. ``worker.py`` (:class:`Worker`): the loops (poll, reaper, cancel watcher, finisher,
   scheduler, heartbeat) and the ordered shutdown;
2. ``intake.py``: entries come in: read.lua for the poll loops, ``XAUTOCLAIM`` for the reaper,
   ``XCLAIM`` of a dead process's entries, each read within slots reserved from the executor;
3. ``execution.py`` (:class:`~dtq.worker.execution.Executor`): the slots, start.lua for each
   read batch, one asyncio task per started entry, cancel requests and lost leases;
4. ``handlers.py`` (:class:`~dtq.worker.handlers.Runner`): the run of one entry: what its
   handler gets (payload, TaskContext), the lease check right before it, the handler under
   its timeout (a sync one on a thread), how it ended as an outcome;
5. ``finish.py`` (:class:`~dtq.worker.finish.Finisher`): finish.lua in one pipeline per
   event-loop tick, the replies, the counts and the end events.

Beside the path: ``heartbeat.py`` (its own thread: touch.lua and the worker hash),
``scheduler.py`` and ``consumers.py`` (the leader's promotions, expiry sweep, stale workers and
idle consumers), ``observer.py`` (the lifecycle events and their hooks), ``telemetry.py``
(metrics and logs as observers), ``outage.py`` (the one "Redis unavailable" reporter),
``supervisor.py`` (``--processes``), ``connection.py`` (the Redis client), ``threads.py``
(the threads of sync handlers, and their interrupts).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from redis.exceptions import RedisError

from dtq.config import Settings, redact_url
from dtq.errors import ConfigError
from dtq.log import configure_logging, set_process_fields
from dtq.worker.supervisor import supervise as _supervise
from dtq.worker.telemetry import WorkerTelemetry as _WorkerTelemetry
from dtq.worker.worker import Worker, WorkerObserver, new_worker_id
from dtq_tasks import Handler, load_task_modules

__all__ = ["Worker", "WorkerObserver", "new_worker_id", "run_worker"]

log = logging.getLogger(__name__)


def _configure_logging(settings: Settings) -> None:
    configure_logging(settings, "worker")


def run_worker(
    settings: Settings,
    *,
    queues: list[str] | None = None,
    concurrency: int | None = None,
    task_modules: list[str] | None = None,
    processes: int = 1,
) -> int:
    """Run a worker (or ``processes`` supervised ones) until SIGTERM/SIGINT.

    The flags arrive parsed and checked by ``dtq worker run`` (:mod:`dtq_cli.parser`: queue
    names, ``concurrency`` and ``processes`` at least 1). Exit code: 0 after a clean stop; 1
    when Redis is unreachable or fails; 2 for a task module that cannot be imported, or no
    metrics port for each process.
    """
    _configure_logging(settings)
    modules = task_modules if task_modules is not None else settings.task_module_list
    served = list(dict.fromkeys(queues or ["default"]))
    try:
        if settings.worker_metrics_port and settings.worker_metrics_port + processes - 1 > 65535:
            raise ConfigError(
                f"DTQ_WORKER_METRICS_PORT={settings.worker_metrics_port} leaves no port for "
                f"each of {processes} processes (child i listens on the port + i)"
            )
        handlers = load_task_modules(modules).handlers
    except ConfigError as exc:
        print(f"dtq worker: {exc.message}", file=sys.stderr)
        return 2
    # What start-up made (modules, handler models, metric families) lives as long as the
    # process: out of the collector's sight, so a full collection scans only what serving
    # makes (otherwise 20-30 ms pauses of the event loop, a tail of the start latency). Before
    # a fork too: the children share those pages instead of each touching its own copy.
    gc.freeze()
    if processes > 1:

        def child_main(child: Settings, ready_fd: int, adopt: Sequence[str]) -> int:
            return _run_one(child, served, concurrency, handlers, ready_fd=ready_fd, adopt=adopt)

        return _supervise(settings, processes=processes, child_main=child_main)
    return _run_one(settings, served, concurrency, handlers)


def _run_one(
    settings: Settings,
    queues: Sequence[str],
    concurrency: int | None,
    handlers: Mapping[str, Handler],
    *,
    ready_fd: int | None = None,
    adopt: Sequence[str] = (),
) -> int:
    """One worker in this process until SIGTERM/SIGINT; ``ready_fd`` (a supervised child) gets
    one byte once its loops run; ``adopt``: dead predecessors whose entries it takes over."""
    worker_id = settings.worker_id or new_worker_id()
    telemetry = _WorkerTelemetry(handlers)
    worker = Worker(
        settings,
        queues=queues,
        concurrency=concurrency,
        handlers=handlers,
        worker_id=worker_id,
        observers=telemetry.observers(worker_id),
        on_redis_op=telemetry.metrics.script_call,
        adopt=adopt,
    )
    telemetry.watch(worker)
    set_process_fields(worker_id=worker.worker_id)
    telemetry.serve(settings.worker_metrics_host, settings.worker_metrics_port)
    try:
        asyncio.run(_serve(worker, ready_fd))
    except (RedisError, OSError) as exc:
        print(
            f"dtq worker: Redis at {redact_url(settings.redis_url)} failed: {exc}", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        telemetry.stop()
    return 0


async def _serve(worker: Worker, ready_fd: int | None = None) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    tell = None if ready_fd is None else asyncio.create_task(_tell_ready(worker, ready_fd))
    try:
        await worker.run()
    finally:
        if tell is not None:
            tell.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _tell_ready(worker: Worker, fd: int) -> None:
    """One byte to the supervisor once the worker is connected and set up, before it takes
    over a dead predecessor's entries: a child that a handler kills while it runs those is a
    child that died serving, not one that cannot start (no start-up backoff for it)."""
    try:
        await worker.prepared.wait()
        os.write(fd, b"1")
    finally:
        os.close(fd)
