"""A dtq worker for the chaos scenarios that need more than ``python -m dtq.worker``:

- ``CHAOS_SKEW_S=<seconds>``: the process's ``time.time``/``time.time_ns`` run that far ahead
  (or behind) of the real clock, as on a host whose clock is wrong. dtq decides with the Redis
  clock (DESIGN 5), so nothing may change.
- ``CHAOS_CRASH=1``: the worker ``os._exit``s at a named point of a task's lifecycle when the
  task's payload asks for it (``crash`` and ``crash_attempt``): ``before_handler`` (start.lua
  made it RUNNING, the handler has not run), ``after_finish`` (finish.lua recorded SUCCEEDED, the
  worker's own bookkeeping has not run) and ``after_retry`` (finish.lua recorded RETRYING);
  ``stop_before_handler`` SIGSTOPs the process instead of ending it (a zombie to be). The
  point ``after_handler`` (the side effect happened, finish.lua has not run) is in the handler
  itself (``chaos_tasks``). The hooks are :class:`dtq.worker.WorkerObserver` methods, dtq's
  public seam for watching a worker.
- ``CHAOS_LOSE_REPLIES=<probability>``: the worker's connections lose replies after Redis ran
  the commands (``chaos_wire``).

Otherwise it is ``dtq worker run``: same settings (DTQ_*), same arguments.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

EXIT_CODES = {"before_handler": 72, "after_finish": 73, "after_retry": 74}


def _skew_clock(skew_s: float) -> None:
    real_time, real_time_ns = time.time, time.time_ns
    skew_ns = int(skew_s * 1e9)
    time.time = lambda: real_time() + skew_s  # type: ignore[assignment]
    time.time_ns = lambda: real_time_ns() + skew_ns  # type: ignore[assignment]


def _crash_point(payload: str, attempt: int) -> str | None:
    try:
        data: Any = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict) or attempt != int(data.get("crash_attempt", 1)):
        return None
    point = data.get("crash")
    return point if isinstance(point, str) else None


def _run_crashing_worker(argv: list[str]) -> int:
    from dtq.config import load_settings
    from dtq.log import configure_logging
    from dtq.worker import Worker, WorkerObserver
    from dtq.worker.observer import TaskFinished, TaskStarted
    from dtq_cli.parser import build_parser
    from dtq_tasks import load_task_modules

    class CrashAt(WorkerObserver):
        def __init__(self) -> None:
            self.points: dict[str, str] = {}  # task id -> crash point of its running attempt

        def task_started(self, event: TaskStarted) -> None:
            point = _crash_point(event.payload, event.attempt)
            if point is not None:
                self.points[event.task_id] = point
            if point == "before_handler":
                os._exit(EXIT_CODES["before_handler"])
            if point == "stop_before_handler":  # the whole process pauses (SIGCONT resumes it)
                os.kill(os.getpid(), signal.SIGSTOP)

        def task_finished(self, event: TaskFinished) -> None:
            point = self.points.pop(event.task_id, None)
            if point == "after_finish" and event.status == "succeeded":
                os._exit(EXIT_CODES["after_finish"])
            if point == "after_retry" and event.status == "retrying":
                os._exit(EXIT_CODES["after_retry"])

    args = build_parser().parse_args(["worker", "run", *argv])
    settings = load_settings()
    configure_logging(settings, "worker")
    handlers = load_task_modules(args.task_modules or settings.task_module_list).handlers
    worker = Worker(
        settings,
        queues=args.queues or ["default"],
        concurrency=args.concurrency,
        handlers=handlers,
        observers=[CrashAt()],
    )

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    asyncio.run(serve())
    return 0


def main(argv: list[str]) -> int:
    skew = float(os.environ.get("CHAOS_SKEW_S") or 0)
    if skew:
        _skew_clock(skew)
    if os.environ.get("CHAOS_CRASH") == "1":
        return _run_crashing_worker(argv)
    if os.environ.get("CHAOS_LOSE_REPLIES"):
        from chaos_wire import run_lossy_worker

        return run_lossy_worker(argv)
    from dtq.worker.__main__ import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
