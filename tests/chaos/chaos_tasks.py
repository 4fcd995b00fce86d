"""Task types of the chaos harness; workers load them with ``--tasks chaos_tasks`` from this
folder (their working directory).

Every execution appends JSON lines to ``$CHAOS_LOG_DIR/exec-<pid>.jsonl``, the side-effect log
that lives outside Redis: ``{"e": "start", task_id, attempt, worker_id, pid, start_ns}`` when the
handler begins and ``{"e": "end", ..., start_ns, end_ns}`` when it returns or raises. Each line
is one ``write`` on an ``O_APPEND`` descriptor, so it is in the kernel the moment the call
returns and survives a ``kill -9`` of the process. Times are ``CLOCK_REALTIME`` read directly,
so the clock-skew scenario (which shifts ``time.time`` in the worker) does not shift them.

Payload fields (all optional except ``seq``):

- ``ms``: how long the handler sleeps (5-50 ms in the harness);
- ``fail``: ``"dead"`` raises PermanentError (a dead letter); ``"retry:N"`` raises
  RetryableError on attempts 1..N;
- ``crash`` with ``crash_attempt`` (default 1): ``"after_handler"`` makes the process
  ``os._exit`` after the side effect is logged and before finish.lua (the other crash points
  are in ``chaos_worker.py``, which sees the worker's lifecycle); ``"after_retry"`` raises
  RetryableError on that attempt so that the crash worker can exit after finish recorded it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from dtq_tasks import PermanentError, RetryableError, TaskContext, task

_FD: dict[int, int] = {}  # pid -> descriptor (a forked child opens its own file)


def _log(record: dict[str, Any]) -> None:
    pid = os.getpid()
    fd = _FD.get(pid)
    if fd is None:
        folder = os.environ.get("CHAOS_LOG_DIR") or "."
        path = os.path.join(folder, f"exec-{pid}.jsonl")
        fd = _FD[pid] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_REALTIME)


class Execution:
    """The start and end lines of one handler run."""

    def __init__(self, ctx: TaskContext, kind: str) -> None:
        self.base = {
            "task_id": ctx.task_id,
            "attempt": ctx.attempt,
            "worker_id": ctx.worker_id,
            "pid": os.getpid(),
            "kind": kind,
        }
        self.start_ns = now_ns()
        _log({"e": "start", **self.base, "start_ns": self.start_ns})

    def end(self, outcome: str) -> None:
        _log(
            {
                "e": "end",
                **self.base,
                "start_ns": self.start_ns,
                "end_ns": now_ns(),
                "outcome": outcome,
            }
        )


def _crash_here(payload: dict[str, Any], ctx: TaskContext, point: str) -> bool:
    return payload.get("crash") == point and ctx.attempt == int(payload.get("crash_attempt", 1))


@task("chaos_work")
async def chaos_work(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """The harness's ordinary task: sleep ``ms``, then succeed (or fail as the payload asks)."""
    ex = Execution(ctx, "work")
    await asyncio.sleep(float(payload.get("ms", 10)) / 1000)
    if _crash_here(payload, ctx, "after_handler"):
        ex.end("crash")
        os._exit(70)
    fail = str(payload.get("fail", ""))
    if fail == "dead":
        ex.end("permanent")
        raise PermanentError(f"seq {payload.get('seq')} is a planned dead letter")
    if fail.startswith("retry:") and ctx.attempt <= int(fail.split(":")[1]):
        ex.end("retryable")
        raise RetryableError(f"seq {payload.get('seq')} asks for a retry")
    if _crash_here(payload, ctx, "after_retry"):
        ex.end("retryable")
        raise RetryableError("the crash worker exits once this retry is recorded")
    ex.end("ok")
    return {"seq": payload.get("seq"), "attempt": ctx.attempt}


@task("chaos_exit")
def chaos_exit(payload: dict[str, Any], ctx: TaskContext) -> None:
    """A poison pill: kills the process running it, every time."""
    Execution(ctx, "exit")
    os._exit(71)


OOM_CHUNK = 64 << 20
OOM_CAP = 64 << 30  # never more than this much address space, limit or not


@task("chaos_oom")
def chaos_oom(payload: dict[str, Any], ctx: TaskContext) -> None:
    """A poison pill: takes address space in 64 MiB chunks until the process's RLIMIT_AS
    refuses (MemoryError), then lets go of it and ends with that error."""
    ex = Execution(ctx, "oom")
    hoard: list[bytes] = []
    try:
        for _ in range(OOM_CAP // OOM_CHUNK):
            hoard.append(bytes(OOM_CHUNK))  # calloc: address space, no page is touched
        raise MemoryError("no RLIMIT_AS stopped the allocation")
    except MemoryError:
        hoard.clear()
        ex.end("memory_error")
        raise


@task("chaos_hang")
async def chaos_hang(payload: dict[str, Any], ctx: TaskContext) -> None:
    """A poison pill: an async handler that never returns (its timeout_ms stops it)."""
    ex = Execution(ctx, "hang")
    try:
        await asyncio.sleep(3600)
    finally:
        ex.end("cancelled")


@task("chaos_hang_sync")
def chaos_hang_sync(payload: dict[str, Any], ctx: TaskContext) -> None:
    """A poison pill: a sync handler that blocks its thread ``hang_s`` seconds, far past its
    timeout (in C: the worker's interrupt is raised when the sleep returns, and the attempt is
    recorded only then)."""
    ex = Execution(ctx, "hang_sync")
    time.sleep(float(payload.get("hang_s", 3)))
    ex.end("late")


@task("chaos_block")
async def chaos_block(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """An async handler that blocks its event loop (``time.sleep``) for ``block_s`` seconds on
    attempts 1..``block_attempts`` (default 1), then returns; later attempts only return."""
    ex = Execution(ctx, "block")
    if ctx.attempt <= int(payload.get("block_attempts", 1)):
        time.sleep(float(payload.get("block_s", 1)))  # noqa: ASYNC251 - the fault itself
    ex.end("ok")
    return {"seq": payload.get("seq"), "attempt": ctx.attempt}
