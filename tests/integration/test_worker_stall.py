"""A worker whose event loop cannot run (an async handler blocking it) is stalled: its heartbeat
thread stops renewing the in-flight leases, so a peer takes every one of them over within the
visibility timeout plus the reaper interval; the worker hash says ``stalled`` while it lasts;
when the loop runs again the worker writes nothing for what it lost and serves new work
(docs/operations.md, "A stalled event loop")."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import httpx
import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.models import TERMINAL as TERMINAL_STATUSES
from dtq.worker.heartbeat import JITTER, stall_after_s
from support import wait_until
from support.worker import WorkerProcess, calls, fast, wait_status, wait_worker_ready

pytestmark = pytest.mark.slow

A, B = "worker-aaaa0001", "worker-bbbb0002"
ENV = {"VISIBILITY_TIMEOUT_S": 1.0, "HEARTBEAT_INTERVAL_S": 0.2, "REAPER_INTERVAL_S": 0.1}
BLOCK_S = 5.0
TERMINAL = {s.value for s in TERMINAL_STATUSES}


async def _status(r: Redis, worker_id: str) -> str | None:
    return await r.hget(keys.worker(worker_id), "status")


async def _started(r: Redis, task_id: str, what: str) -> bool:
    return what in await calls(r, task_id)


async def test_a_stalled_loop_gives_its_tasks_to_a_peer_and_writes_nothing_late(
    spawn: Callable[..., WorkerProcess], settings: Settings, r: Redis, queue: Queue
) -> None:
    port = free_port()
    a = spawn(A, **ENV, WORKER_METRICS_PORT=port, WORKER_METRICS_HOST="127.0.0.1")
    await wait_worker_ready(r, A)
    # Besides the blocking handler: one task that ends during the stall (its finish comes late,
    # once the loop runs), one still running after it (its lease is found lost).
    short = await queue.submit("sp_sleep", {"by_attempt": [2.0, 0.05]}, max_attempts=3)
    long = await queue.submit("sp_sleep", {"by_attempt": [30, 0.05]}, max_attempts=3)
    for t in (short, long):
        await wait_until(lambda t=t: _started(r, t.task_id, f"start:1:{A}"), 10, "A runs it")
    hog = await queue.submit("sp_hog", {"by_attempt": [BLOCK_S, 0]}, max_attempts=3)
    await wait_until(lambda: _started(r, hog.task_id, f"start:1:{A}"), 10, "A runs the hog")
    blocked_at = time.monotonic()

    async def stalled() -> bool:
        return await _status(r, A) == "stalled"

    await wait_until(stalled, 3, "A's hash says stalled")
    b = spawn(B, **ENV)
    await wait_worker_ready(r, B)
    # The leases were last renewed before the stall was found (at most the stall limit plus a
    # beat after the block began); a peer claims them a visibility timeout later, at its next
    # reaper pass: whichever comes last, B's start or that.
    s = fast(settings, **{k.lower(): v for k, v in ENV.items()})
    claimable = blocked_at + stall_after_s(s) + s.heartbeat_interval_s * (1 + JITTER)
    deadline = max(time.monotonic(), claimable + s.visibility_timeout_s) + s.reaper_interval_s
    deadline += 1.5  # margin: two shared cores, subprocesses
    for t in (hog, short, long):
        h = await wait_status(r, t.task_id, "succeeded", timeout_s=deadline - time.monotonic())
        assert (h["worker_id"], h["attempt"]) == (B, "2")
    assert await _status(r, A) == "stalled"  # the block lasts: B was not waiting for its end

    async def serving_again() -> bool:
        return await _status(r, A) in {"ready", "busy"}

    await wait_until(serving_again, BLOCK_S + 5, "A's loop runs again")
    for t in (hog, short):  # ended during the stall: finished late, or stopped as lost first
        await wait_until(lambda t=t: _dropped(a, t.task_id), 5, f"A drops {t.task_id}")
    await wait_until(lambda: _logged(a, f"{long.task_id} attempt 1: lease lost"), 5, "long lost")
    for t in (hog, short, long):
        history = [json.loads(e) for e in await r.lrange(keys.history(t.task_id), 0, -1)]
        ends = [e for e in history if e["to"] in TERMINAL]
        assert [(e["to"], e.get("worker_id")) for e in ends] == [("succeeded", B)], history
        assert [e["to"] for e in history if e.get("worker_id") == A] == ["running"], history
        h = await r.hgetall(keys.task(t.task_id))
        assert (h["status"], h["worker_id"], h["attempt"]) == ("succeeded", B, "2")
    out = a.output()
    assert out.count("event loop stalled") == 1, out
    assert out.count("event loop runs again after a stall of") == 1, out
    assert " WARNING " in _line(out, "event loop stalled")
    assert " INFO " in _line(out, "event loop runs again")
    for t in (hog, short, long):
        assert f"task {t.task_id} attempt 1: succeeded" not in out
    assert await r.hget(keys.worker(A), "tasks_processed") == "0"  # nothing counted as its own

    b.signal(signal.SIGTERM)
    assert b.wait(15) == 0
    after = await queue.submit("sp_sleep", {"s": 0.05})
    h = await wait_status(r, after.task_id, "succeeded", timeout_s=10)
    assert h["worker_id"] == A

    async def counted() -> bool:
        return await r.hget(keys.worker(A), "tasks_processed") == "1"

    await wait_until(counted, 5, "A counts the task it finished")
    # Its metrics count that one execution only: the dropped ones ended on B.
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    ended = [
        line
        for line in text.splitlines()
        if line.startswith(("dtq_worker_tasks_total{", "dtq_task_attempts_total{"))
    ]
    assert {line.rsplit(" ", 1)[1] for line in ended} == {"1.0"}, ended
    assert all('task_type="sp_sleep"' in line and 'result="success"' in line for line in ended)


async def _logged(proc: WorkerProcess, text: str) -> bool:
    return text in proc.output()


async def _dropped(proc: WorkerProcess, task_id: str) -> bool:
    out = proc.output()
    return f"{task_id} attempt 1: finish fenced" in out or f"{task_id} attempt 1: lease lost" in out


def _line(out: str, text: str) -> str:
    return next(line for line in out.splitlines() if text in line)
