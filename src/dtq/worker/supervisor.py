"""``--processes N``: N worker processes under one supervisor (docs/operations.md).

Sync handlers share one GIL per process; CPU-bound task types (``fibonacci_task``) use every
core only with several processes. The supervisor has imported the task modules already; it
forks N children, each running a :class:`~dtq.worker.Worker` with a worker id of its own
(``DTQ_WORKER_ID-<slot>`` when that is set, else a new ``worker-<8 hex>`` at each start) and,
when the metrics endpoint is on, the port ``DTQ_WORKER_METRICS_PORT + slot``. A fork starts a
child in milliseconds, since nothing has to be imported again, so losing a child costs little.

A child that dies (a handler called ``os._exit``, the OOM killer, SIGKILL) is replaced, and its
replacement takes over the dead child's pending entries at once (:meth:`Intake.adopt
<dtq.worker.intake.Intake.adopt>`): the supervisor has reaped the process, so nothing can still
run them and they need not wait out the visibility timeout. Each is a crash redelivery for
start.lua (attempt + 1), so a handler that kills its process every time ends DEAD_LETTERED
with WorkerLost after max_attempts: it never loops. Restart policy:

- a child that died after it was ready (it signals readiness over a pipe once it is
  connected and set up, before it takes over its predecessors' entries, so one that a pill
  among those kills counts as ready) is replaced at once, unless its slot has lost more than
  ``QUICK_DEATHS`` ready children in the last ``QUICK_WINDOW_S`` seconds: then the slot waits
  ``QUICK_BACKOFF_S``;
- a child that died before it was ready (Redis unreachable, a metrics port in use) is started
  again after a delay that doubles with each such death in a row (0.5 s up to 30 s).

SIGTERM or SIGINT is passed on to every child, which drains; a second one makes them stop
without waiting for the drain; a child still alive after the drain timeout (plus a margin) is
killed. Children run in their own session so a terminal's Ctrl-C reaches them only once,
through the supervisor. Nothing in the supervisor opens a connection or starts a thread: a
child forked from it starts clean.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from dtq.config import Settings
from dtq.worker.worker import new_worker_id

__all__ = ["ChildMain", "child_settings", "child_worker_id", "supervise"]

log = logging.getLogger(__name__)

POLL_S = 0.05
MAX_BACKOFF_S = 30.0
KILL_MARGIN_S = 10.0
QUICK_WINDOW_S = 10.0
QUICK_DEATHS = 20
QUICK_BACKOFF_S = 1.0
ADOPT_MAX = 8  # dead worker ids of a slot whose entries its next child takes over
CHILD_CRASHED = 70  # a child's exit code when its main raised (EX_SOFTWARE)

ChildMain = Callable[[Settings, int, Sequence[str]], int]
"""What a forked child runs: (its settings, the fd to write one byte to once it is ready, the
worker ids whose entries it takes over) -> its exit code."""


@dataclass
class _Child:
    index: int
    pid: int | None = None
    worker_id: str = ""
    ready_fd: int | None = None
    ready: bool = False
    started: float = 0.0
    failures: int = 0  # deaths before readiness, in a row
    ready_deaths: list[float] = field(default_factory=list)
    restart_at: float = 0.0
    adopt: list[str] = field(default_factory=list)  # the slot's recent dead: its next child's


def child_worker_id(settings: Settings, index: int) -> str:
    """``DTQ_WORKER_ID-<slot>`` when the operator set an id, else a fresh ``worker-<8 hex>``."""
    return f"{settings.worker_id}-{index}"[:64] if settings.worker_id else new_worker_id()


def child_settings(settings: Settings, index: int, worker_id: str) -> Settings:
    """The supervisor's settings with the child's worker id and metrics port (port + slot)."""
    update: dict[str, object] = {"worker_id": worker_id}
    if settings.worker_metrics_port:
        update["worker_metrics_port"] = settings.worker_metrics_port + index
    return settings.model_copy(update=update)


def supervise(settings: Settings, *, processes: int, child_main: ChildMain) -> int:
    """Run ``processes`` forked children until SIGTERM/SIGINT; returns the exit code (0)."""
    stopping = threading.Event()
    signals = 0
    children = [_Child(i) for i in range(processes)]

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        stopping.set()
        if signals > 1:  # a second signal: the children stop without waiting for the drain
            _signal_all(children, signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log.info("supervisor %d: starting %d worker processes", os.getpid(), processes)
    try:
        while not stopping.is_set():
            now = time.monotonic()
            for child in children:
                _check(child, children, settings, child_main, now)
            stopping.wait(POLL_S)
        log.info("supervisor %d: stopping %d worker processes", os.getpid(), processes)
        _signal_all(children, signal.SIGTERM)
        deadline = time.monotonic() + settings.drain_timeout_s + KILL_MARGIN_S
        while any(c.pid is not None for c in children) and time.monotonic() < deadline:
            for child in children:
                _reap(child)
            time.sleep(POLL_S)
        for child in children:
            if child.pid is not None:
                log.error("worker process %d did not stop: killed", child.pid)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in children:  # never leave a child behind, even on an error here
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, 0)
                child.pid = None
            _close_ready(child)
    return 0


def _check(
    child: _Child,
    children: Sequence[_Child],
    settings: Settings,
    child_main: ChildMain,
    now: float,
) -> None:
    if child.pid is not None:
        pid, worker_id = child.pid, child.worker_id
        code = _reap(child)  # once it has exited, reads its readiness byte
        if code is None:
            return
        was_ready = child.ready
        lived = now - child.started
        # The next child takes over this one's entries and those of the slot's other recent
        # dead (one may have died before it had claimed its predecessor's); an id that holds
        # nothing costs one XPENDING per stream. The same id comes back when DTQ_WORKER_ID is set.
        recent = child.adopt if lived < QUICK_WINDOW_S else []
        others = [w for w in recent if w != worker_id][-(ADOPT_MAX - 1) :]
        child.adopt = [*others, worker_id]
        if was_ready:
            child.failures = 0
            child.ready_deaths = [t for t in child.ready_deaths if now - t < QUICK_WINDOW_S]
            child.ready_deaths.append(now)
            delay = QUICK_BACKOFF_S if len(child.ready_deaths) > QUICK_DEATHS else 0.0
        else:
            child.failures += 1
            delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (child.failures - 1))
        log.error(
            "worker process %d (%s) exited with %s after %.1fs%s: restarting%s",
            pid,
            worker_id,
            code,
            lived,
            "" if was_ready else " before it was ready",
            f" in {delay:.1f}s" if delay else " now",
        )
        child.restart_at = now + delay
    if now >= child.restart_at:
        _fork(child, children, settings, child_main, now)


def _fork(
    child: _Child,
    children: Sequence[_Child],
    settings: Settings,
    child_main: ChildMain,
    now: float,
) -> None:
    worker_id = child_worker_id(settings, child.index)
    adopt = list(child.adopt)
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: it never returns into the supervisor's loop
        code = CHILD_CRASHED
        try:
            os.setsid()
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, signal.SIG_DFL)
            os.close(read_fd)
            for other in children:
                if other.ready_fd is not None:
                    os.close(other.ready_fd)
            code = child_main(child_settings(settings, child.index, worker_id), write_fd, adopt)
        except BaseException:
            log.exception("worker process %d (%s) failed", os.getpid(), worker_id)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    child.pid, child.worker_id, child.ready_fd = pid, worker_id, read_fd
    child.ready, child.started = False, now
    log.info(
        "worker process %d started (slot %d, %s%s)",
        pid,
        child.index,
        worker_id,
        f", taking over {', '.join(adopt)}" if adopt else "",
    )


def _read_ready(child: _Child) -> None:
    """Set ``child.ready`` if the child wrote its readiness byte (connected and set up)."""
    if not child.ready and child.ready_fd is not None:
        try:
            got = os.read(child.ready_fd, 16)
        except BlockingIOError:
            got = b""
        if got:
            child.ready = True


def _reap(child: _Child) -> int | None:
    """The child's exit code once it has exited (and is reaped), else None."""
    if child.pid is None:
        return None
    try:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere: gone all the same
        pid, status = child.pid, 0
    if pid == 0:
        return None
    child.pid = None
    # After waitpid, not before: the byte stays in the pipe until read, so once the child has
    # exited this one read tells whether it ever said it was ready (even just before dying).
    _read_ready(child)
    _close_ready(child)
    return os.waitstatus_to_exitcode(status)


def _close_ready(child: _Child) -> None:
    if child.ready_fd is not None:
        with contextlib.suppress(OSError):
            os.close(child.ready_fd)
        child.ready_fd = None


def _signal_all(children: Sequence[_Child], signum: int) -> None:
    for child in children:
        if child.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)
