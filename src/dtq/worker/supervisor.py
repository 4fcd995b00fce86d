"""``--processes N``: N worker processes under one supervisor (issue 3, item 6).

Sync handlers share one GIL per process; CPU-bound task types (``fibonacci_task``) use every
core only with several processes. The supervisor starts N children (``python -m dtq.worker``
with the same queues, concurrency and task modules, and the supervisor's settings in their
environment), each with its own worker id. A child that dies is started again, with a growing
delay while it keeps dying young, so a handler that kills its process cannot make a hot loop
(its task itself ends DEAD_LETTERED with WorkerLost after max_attempts). SIGTERM or SIGINT is
passed on to every child, which drains; a child still alive after the drain timeout (plus a
margin) is killed. Children run in their own session so a terminal's Ctrl-C reaches them only
once, through the supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from dtq.config import Settings

__all__ = ["child_command", "child_env", "supervise"]

log = logging.getLogger(__name__)

POLL_S = 0.2
YOUNG_S = 10.0
MAX_BACKOFF_S = 30.0
KILL_MARGIN_S = 10.0


@dataclass
class _Child:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0
    restart_at: float = 0.0


def child_command(
    queues: Sequence[str], concurrency: int | None, task_modules: Sequence[str]
) -> list[str]:
    cmd = [sys.executable, "-m", "dtq.worker"]
    for q in queues:
        cmd += ["--queue", q]
    if concurrency is not None:
        cmd += ["--concurrency", str(concurrency)]
    for m in task_modules:
        cmd += ["--tasks", m]
    return cmd


def child_env(settings: Settings, index: int) -> dict[str, str]:
    """The supervisor's settings as DTQ_* variables, with a worker id of the child's own and,
    when the metrics endpoint is on, the metrics port ``DTQ_WORKER_METRICS_PORT + index``."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        env[f"DTQ_{name.upper()}"] = (
            ("true" if value else "false") if isinstance(value, bool) else str(value)
        )
    if settings.worker_metrics_port:
        env["DTQ_WORKER_METRICS_PORT"] = str(settings.worker_metrics_port + index)
    if settings.worker_id:
        env["DTQ_WORKER_ID"] = f"{settings.worker_id}-{index}"[:64]
    else:
        env.pop("DTQ_WORKER_ID", None)
    return env


def supervise(
    settings: Settings,
    *,
    queues: Sequence[str],
    concurrency: int | None,
    task_modules: Sequence[str],
    processes: int,
) -> int:
    """Run ``processes`` children until SIGTERM/SIGINT; returns the exit code (0)."""
    stopping = threading.Event()
    signals = 0
    children: list[_Child] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        stopping.set()
        if signals > 1:  # a second signal: the children stop without waiting for the drain
            _signal_all(children, signal.SIGTERM)

    cmd = child_command(queues, concurrency, task_modules)
    children.extend(_Child(i) for i in range(processes))
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log.info("supervisor %d: starting %d worker processes", os.getpid(), processes)
    try:
        while not stopping.is_set():
            now = time.monotonic()
            for child in children:
                _check(child, cmd, settings, now)
            stopping.wait(POLL_S)
        log.info("supervisor %d: stopping %d worker processes", os.getpid(), processes)
        _signal_all(children, signal.SIGTERM)
        deadline = time.monotonic() + settings.drain_timeout_s + KILL_MARGIN_S
        for child in children:
            if child.process is None:
                continue
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker process %d did not stop: killed", child.process.pid)
                child.process.kill()
                child.process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in children:  # never leave a child behind, even on an error here
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
                child.process.wait()
    return 0


def _check(child: _Child, cmd: list[str], settings: Settings, now: float) -> None:
    proc = child.process
    if proc is not None:
        code = proc.poll()
        if code is None:
            return
        lived = now - child.started
        child.failures = child.failures + 1 if lived < YOUNG_S else 0
        delay = min(MAX_BACKOFF_S, 0.5 * 2 ** max(0, child.failures - 1))
        log.error(
            "worker process %d exited with %s after %.1fs: restarting in %.1fs",
            proc.pid,
            code,
            lived,
            delay,
        )
        child.process = None
        child.restart_at = now + delay
    if now < child.restart_at:
        return
    child.process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
        cmd, env=child_env(settings, child.index), start_new_session=True
    )
    child.started = now
    log.info("worker process %d started (slot %d)", child.process.pid, child.index)


def _signal_all(children: Sequence[_Child], signum: int) -> None:
    for child in children:
        if child.process is not None and child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signum)
