"""Schedules: 1,000 interval schedules due every second, fired by one worker process.

``schedules.tick_lag``: 1,000 schedules ``every=1`` (queue ``sched``, overlap ``allow``, a no-op
task type), all due at the same instant each second, with ``start_at`` / ``end_at`` giving each
exactly ``SECONDS`` ticks. One worker process (the scheduler leader, serving only ``default``:
nobody consumes ``sched``, so the figures are the cost of firing alone, not of running the
tasks) fires them. The lag of a firing is the Redis time of its ``fire.lua`` call (the task's
``created_ms``) minus its tick, as the schedule's history records it (``lag_ms``, 1 ms
resolution): p50, p99 and max over every firing; firings/s; Redis CPU (INFO CPU) and worker CPU
(/proc) per firing over the firing window; ``fire.lua``'s own share (INFO commandstats, EVALSHA).

``schedules.exactly_once``: the same run checked tick by tick: every schedule has exactly
``SECONDS`` fired ticks, one per second from its start, each with its own task; the ``sched``
queue holds exactly schedules x seconds tasks.

``schedules.drain_ratio``: the drain scenario's setup (no-op tasks queued, one worker process
with the run's ``--concurrency``) with and without the 1,000 schedules firing, alternated
(A B B A A B) so the machine's drift hits both. The worker of each round is the one that fires
(same worker count as the drain): it starts with ``default`` paused, becomes the leader, fires
for a couple of seconds (B rounds) and then the queue is resumed and drained; tasks/s from the
first completion to the last, as in ``drain``. The figure is the median with schedules over the
median without.

``schedules.drain_ratio_separate``: the same, with the firing leader in a worker process of its
own (serving a queue with no task, started first so that it leads) beside the drain's worker:
how much firing costs the other queues when it is not their worker's event loop that fires
(both processes and Redis still share this machine's cores).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from bench.harness import (
    NOOP_TASK,
    Env,
    Managed,
    Result,
    iso_ms,
    live_entries,
    percentile,
    redis_now_ms,
    statuses,
    wait_until,
)
from bench.profile import process_cpu_s
from bench.workers import spawn_worker
from dtq import Queue, keys
from dtq.models import TaskStatus

__all__ = ["run"]

QUEUE = "sched"
LAG_TARGET_MS = 100
DRAIN_TARGET = 0.95
ORDER = "ABBAAB"  # A: no schedules, B: schedules firing


def _name(i: int) -> str:
    return f"bench-{i:04d}"


def _iso(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


async def put_schedules(
    q: Queue, n: int, *, start_ms: int | None = None, end_ms: int | None = None
) -> None:
    """``n`` schedules every second on ``sched`` (overlap allow), 50 puts in flight."""
    extra: dict[str, Any] = {}
    if start_ms is not None:
        extra["start_at"] = _iso(start_ms)
    if end_ms is not None:
        extra["end_at"] = _iso(end_ms)

    async def put(i: int) -> None:
        await q.put_schedule(
            _name(i), every=1, task_type=NOOP_TASK, queue=QUEUE, overlap="allow", **extra
        )

    for lo in range(0, n, 50):
        await asyncio.gather(*(put(i) for i in range(lo, min(n, lo + 50))))


async def _leader(worker: Managed, r: Redis, timeout_s: float = 60) -> None:
    """Wait until the worker holds the scheduler lock (it is the one that fires on time)."""

    async def held() -> bool:
        return not worker.alive() or bool(await r.exists(keys.SCHEDULER_LOCK))

    if not await wait_until(held, timeout_s, interval_s=0.05):
        raise RuntimeError(f"the worker did not take the scheduler lock within {timeout_s:.0f} s")
    if not worker.alive():
        raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.tail()}")


async def _sleep_until(r: Redis, at_ms: int) -> None:
    left_ms = at_ms - await redis_now_ms(r)
    if left_ms > 0:
        await asyncio.sleep(left_ms / 1000)


async def _redis_cpu(r: Redis) -> tuple[float, int, int]:
    """(used CPU seconds, EVALSHA calls, EVALSHA usec) of the server."""
    cpu = await r.info("cpu")
    stats = await r.info("commandstats")
    ev = stats.get("cmdstat_evalsha", {})
    used = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return used, int(ev.get("calls", 0)), int(ev.get("usec", 0))


async def _histories(r: Redis, n: int) -> list[list[dict[str, Any]]]:
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.lrange(keys.schedule_history(_name(i), QUEUE), 0, -1)
    return [[json.loads(e) for e in h] for h in await pipe.execute()]


async def lag_run(env: Env, n: int, seconds: int) -> list[Result]:
    """The tick-lag and exactly-once figures (see the module docstring)."""
    await env.flush()
    q = await env.queue()
    r = await env.redis()
    try:
        worker = spawn_worker(env, concurrency=env.concurrency)
        await _leader(worker, r)
        # The first tick far enough ahead that every put is done and the firer has seen them.
        now = await redis_now_ms(r)
        start = (now // 1000 + 4) * 1000
        end = start + seconds * 1000 - 500  # end_at is inclusive: exactly `seconds` ticks
        t = time.monotonic()
        await put_schedules(q, n, start_ms=start, end_ms=end)
        put_s = time.monotonic() - t
        if await redis_now_ms(r) > start - 500:
            raise RuntimeError(f"putting {n} schedules took {put_s:.1f} s: start too close")
        await _sleep_until(r, start - 200)
        cpu0, calls0, usec0 = await _redis_cpu(r)
        wcpu0 = process_cpu_s(worker.proc.pid)[0]
        await _sleep_until(r, end + 700)  # the last tick was at end - 500
        cpu1, calls1, usec1 = await _redis_cpu(r)
        wcpu1 = process_cpu_s(worker.proc.pid)[0]
        if not worker.alive():
            raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.tail()}")
        hists = await _histories(r, n)
        fired_counts = await _fired_counters(r, n)
        queued = await live_entries(r, QUEUE)
    finally:
        env.stop_children()
        await q.close()
        await r.aclose()
    await env.flush()

    lags: list[float] = []
    first_of_tick: dict[int, float] = {}  # the lag of each tick's first firing
    last_fire_ms = 0
    wrong: list[str] = []
    expected = [start + 1000 * k for k in range(seconds)]
    for i, hist in enumerate(hists):
        fired = [e for e in hist if e.get("decision") == "fired"]
        ticks = sorted(round(iso_ms(e["tick"])) for e in fired)
        tasks = {e["task_id"] for e in fired}
        if ticks != expected or len(tasks) != seconds or fired_counts[i] != seconds:
            wrong.append(f"{_name(i)}: {len(ticks)} fired, {len(tasks)} tasks")
        others = {e.get("decision") for e in hist} - {"fired", "created"}
        if others:
            wrong.append(f"{_name(i)}: decisions {sorted(others)}")
        for e in fired:
            lags.append(float(e["lag_ms"]))
            tick = round(iso_ms(e["tick"]))
            first_of_tick[tick] = min(first_of_tick.get(tick, math.inf), float(e["lag_ms"]))
            last_fire_ms = max(last_fire_ms, round(iso_ms(e["tick"])) + int(e["lag_ms"]))
    total = n * seconds
    if not lags:
        raise RuntimeError("no schedule fired")
    span_s = (last_fire_ms - start) / 1000
    firings = len(lags)
    redis_us = (cpu1 - cpu0) * 1e6 / firings
    fire_us = (usec1 - usec0) / firings
    worker_us = (wcpu1 - wcpu0) * 1e6 / firings
    p50, p99, mx = percentile(lags, 50), percentile(lags, 99), max(lags)
    values: dict[str, Any] = {
        "p50_ms": p50,
        "p95_ms": percentile(lags, 95),
        "p99_ms": p99,
        "max_ms": mx,
        "first_firing_p50_ms": percentile(list(first_of_tick.values()), 50),
        "firings": firings,
        "firings_per_s": firings / span_s if span_s > 0 else float("nan"),
        "schedules": n,
        "seconds": seconds,
        "redis_cpu_us_per_firing": redis_us,
        "evalsha_us_per_firing": fire_us,
        "evalsha_calls_per_firing": (calls1 - calls0) / firings,
        "worker_cpu_us_per_firing": worker_us,
        "put_s": put_s,
    }
    exact = not wrong and queued == total and firings == total
    return [
        Result(
            "schedules.tick_lag",
            figure="p99_ms",
            unit="ms p99",
            values=values,
            target=f"p99 <= {LAG_TARGET_MS} ms",
            met=p99 <= LAG_TARGET_MS,
            note=f"{n:,} schedules every 1 s for {seconds} s, one worker (the leader; nobody "
            f"consumes {QUEUE!r}): tick -> enqueue p50 {p50:.0f} / p99 {p99:.0f} / max "
            f"{mx:.0f} ms (Redis clock, 1 ms); {firings / max(span_s, 1e-9):,.0f} firings/s; "
            f"per firing {redis_us:.0f} us Redis CPU ({fire_us:.0f} us in EVALSHA), "
            f"{worker_us:.0f} us worker CPU",
        ),
        Result(
            "schedules.exactly_once",
            figure="firings",
            unit="firings",
            values={
                "firings": firings,
                "expected": total,
                "tasks_queued": queued,
                "wrong": wrong[:5],
            },
            target="one task per schedule per tick",
            met=exact,
            note=f"{n:,} schedules x {seconds} ticks: {firings:,} fired, {queued:,} tasks in "
            f"{QUEUE!r}, {len(wrong)} schedule(s) off",
        ),
    ]


async def _fired_counters(r: Redis, n: int) -> list[int]:
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.hget(keys.schedule(_name(i), QUEUE), "fired")
    return [int(v or 0) for v in await pipe.execute()]


async def _drain_round(
    env: Env, n_tasks: int, n_sched: int, warm_s: float, separate: bool = False
) -> dict[str, float]:
    """One drain of ``n_tasks`` no-op tasks, with ``n_sched`` schedules firing (0: none). With
    ``separate``, the firing leader is a second worker process (serving a queue of its own,
    with no task), started first so that it leads; the drain's worker then fires nothing."""
    await env.flush()
    q = await env.queue()
    r = await env.redis()
    try:
        ids = await env.fill(q, n_tasks, NOOP_TASK)
        await q.pause_queue("default")
        if n_sched:
            await put_schedules(q, n_sched)
        if separate:
            firer = spawn_worker(env, concurrency=1, queues=["firer"])
            await _leader(firer, r)
            worker = spawn_worker(env, concurrency=env.concurrency, queues=["default"])
        else:
            worker = spawn_worker(env, concurrency=env.concurrency)
            await _leader(worker, r)
        await asyncio.sleep(warm_s)  # the same in both: B's firer settles, A just waits

        async def firing() -> bool:
            return await live_entries(r, QUEUE) > 0

        if n_sched and not await wait_until(firing, 30, interval_s=0.05):
            raise RuntimeError("the schedules did not fire before the drain")
        fired0 = await live_entries(r, QUEUE)
        cpu0 = (await _redis_cpu(r))[0]
        wcpu0 = process_cpu_s(worker.proc.pid)[0]
        t = time.monotonic()
        await q.resume_queue("default")

        async def drained() -> bool:
            return not worker.alive() or not await live_entries(r)

        await wait_until(drained, 300, interval_s=0.05)
        wall = time.monotonic() - t
        wcpu = process_cpu_s(worker.proc.pid)[0] - wcpu0
        cpu = (await _redis_cpu(r))[0] - cpu0
        if not worker.alive():
            raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.tail()}")
        fired = await live_entries(r, QUEUE) - fired0
        rows: list[list[str | None]] = []

        async def final() -> bool:
            nonlocal rows
            rows = await statuses(r, ids, "status", "finished_at")
            return all(st == TaskStatus.SUCCEEDED.value for st, _ in rows)

        await wait_until(final, 10, interval_s=0.2)
    finally:
        env.stop_children()
        await q.close()
        await r.aclose()
    done = [iso_ms(fin) for st, fin in rows if st == TaskStatus.SUCCEEDED.value and fin]
    if len(done) != n_tasks:
        raise RuntimeError(f"{n_tasks - len(done)} of {n_tasks} tasks did not succeed")
    span = (max(done) - min(done)) / 1000
    return {
        "rate": (n_tasks - 1) / span if span > 0 else float("nan"),
        "firings_per_s": fired / wall if wall > 0 else 0.0,
        "worker_us": wcpu * 1e6 / n_tasks,
        "redis_us": cpu * 1e6 / n_tasks,
    }


async def drain_run(
    env: Env, n_sched: int, n_tasks: int, order: str, separate: bool = False
) -> Result:
    """The drain with (B) and without (A) ``n_sched`` schedules firing, rounds in ``order``;
    ``separate``: the firing leader is another worker process (:func:`_drain_round`)."""
    rounds: list[tuple[str, dict[str, float]]] = []
    warm_s = 1.0 if env.quick else 2.5
    for kind in order:
        res = await _drain_round(env, n_tasks, n_sched if kind == "B" else 0, warm_s, separate)
        rounds.append((kind, res))
    await env.flush()
    without = [res["rate"] for kind, res in rounds if kind == "A"]
    with_ = [res["rate"] for kind, res in rounds if kind == "B"]
    fps = [res["firings_per_s"] for kind, res in rounds if kind == "B"]
    ratio = statistics.median(with_) / statistics.median(without)

    def cpu(kind: str, key: str) -> float:
        return statistics.median(res[key] for k, res in rounds if k == kind)

    cpu_a = cpu("A", "worker_us") + cpu("A", "redis_us")
    cpu_b = cpu("B", "worker_us") + cpu("B", "redis_us")
    who = (
        "one worker (--concurrency {c}) for 'default', and the firing leader in a worker "
        "process of its own"
        if separate
        else "one worker (--concurrency {c}) that is also the firing leader"
    ).format(c=env.concurrency)
    return Result(
        "schedules.drain_ratio_separate" if separate else "schedules.drain_ratio",
        figure="ratio",
        unit="x without",
        values={
            "ratio": ratio,
            "rate_without": statistics.median(without),
            "rate_with": statistics.median(with_),
            "rounds": [f"{kind} {res['rate']:.0f}" for kind, res in rounds],
            "cpu_us_per_task_without": {
                "worker": cpu("A", "worker_us"),
                "redis": cpu("A", "redis_us"),
            },
            "cpu_us_per_task_with": {
                "worker": cpu("B", "worker_us"),
                "redis": cpu("B", "redis_us"),
            },
            "firings_per_s_during_drain": fps,
            "tasks": n_tasks,
            "concurrency": env.concurrency,
        },
        ratios={"cpu_per_task_without": cpu_b / cpu_a if cpu_a else float("nan")},
        target=f">= {DRAIN_TARGET} (within 5 % of without)",
        met=ratio >= DRAIN_TARGET,
        note=f"{n_tasks:,} no-op tasks on 'default', {who}; rounds {'-'.join(order)} (A without, "
        f"B with {n_sched:,} schedules every 1 s, ~{statistics.median(fps):,.0f} firings/s "
        f"during B's drains); medians {statistics.median(with_):,.0f} vs "
        f"{statistics.median(without):,.0f} tasks/s; worker + Redis CPU per drained task "
        f"{cpu_b:.0f} vs {cpu_a:.0f} us (the firing included)",
    )


async def run(env: Env) -> list[Result]:
    n = env.n(1_000, 250)  # quick: still more than one of the firer's chunks (FIRE_CHUNK)
    seconds = env.n(20, 3)
    out = await lag_run(env, n, seconds)
    order = "AB" if env.quick else ORDER
    out.append(await drain_run(env, n, env.n(40_000, 300), order))
    out.append(await drain_run(env, n, env.n(40_000, 300), order, separate=True))
    return out
