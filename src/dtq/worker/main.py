"""The worker's entry point: :func:`run_worker`, what ``dtq worker run`` calls (and
``python -m dtq.worker`` through it) with the flags ``dtq_cli`` parsed. It loads the task
modules, then runs one :class:`~dtq.worker.worker.Worker` in this process, or several under
the supervisor (:mod:`dtq.worker.supervisor`), each with its telemetry, until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from redis.exceptions import RedisError

from dtq.config import Settings, describe_redis
from dtq.errors import ConfigError
from dtq.log import configure_logging, set_process_fields
from dtq.worker.supervisor import supervise
from dtq.worker.telemetry import WorkerTelemetry
from dtq.worker.worker import Worker, new_worker_id
from dtq_tasks import Handler, load_task_modules

__all__ = ["run_worker"]


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
    when Redis is unreachable or fails; 2 for a task module that cannot be imported, no
    metrics port for each process, or a worker id a live worker has.
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

        return supervise(settings, processes=processes, child_main=child_main)
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
    telemetry = WorkerTelemetry(handlers)
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
    except ConfigError as exc:  # its id is a live worker's (Worker: one worker per id)
        print(f"dtq worker: {exc.message}", file=sys.stderr)
        return 2
    except (RedisError, OSError) as exc:
        print(f"dtq worker: Redis at {describe_redis(settings)} failed: {exc}", file=sys.stderr)
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
