"""Expiration: 100,000 delayed tasks whose deadline passes at the same moment.

1. Sweep throughput: the scheduler's ``tick()`` (``dtq.worker.scheduler.Scheduler``) called in a
   loop in this process until ``dtq:expiry`` is empty; tasks/s and total seconds.
2. Its effect on a running worker: the same 100,000 tasks expire while a worker (whose own
   scheduler sweeps them) serves the 200 tasks/s latency load; submit->start p99 during the
   sweep, beside the same load on the same worker just before the deadline (the difference is
   the sweep's own effect); and how long the worker's sweep took.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.asyncio import Redis

from bench.harness import NOOP_TASK, Env, Result, redis_now_ms, wait_until
from bench.scenarios.latency import paced_load, warm_worker
from bench.workers import spawn_worker
from dtq import Queue, keys
from dtq.store import ms_to_dt
from dtq.worker.scheduler import SWEEP_RATE


async def _fill_expiring(env: Env, q: Queue, r: Redis, n: int, extra_s: float) -> int:
    """Queue ``n`` delayed tasks (due in an hour) that all expire at one moment, after they are
    all submitted plus ``extra_s``; returns that moment (Redis clock, ms)."""
    margin_s = n / max(env.enqueue_rate, 1000) * 3 + (0.5 if env.quick else 3) + extra_s
    deadline_ms = await redis_now_ms(r) + int(margin_s * 1000)
    await env.fill(q, n, NOOP_TASK, delay_seconds=3600, expires_at=ms_to_dt(deadline_ms))
    return deadline_ms


async def _wait_for(r: Redis, at_ms: int) -> None:
    now = await redis_now_ms(r)
    if now < at_ms:
        await asyncio.sleep((at_ms - now) / 1000)


async def _sweep(env: Env, n: int) -> list[Result]:
    """The scheduler's sweep as it ships (``tick()`` in a loop, resting 20 ms after a tick
    that expired nothing), then the sweep's own cost: the scheduler's batch
    (``admin.sweep_due``) back to back."""
    from dtq.admin import sweep_due
    from dtq.worker.scheduler import Scheduler

    out: list[Result] = []
    for how in ("scheduler", "sweep_due"):
        # The sweep's own cost per task needs no 100,000: a fifth of them measures it.
        count = n if how == "scheduler" else max(n // 5, 100)
        await env.flush()
        q = await env.queue()
        r = await env.redis()
        try:
            deadline_ms = await _fill_expiring(env, q, r, count, extra_s=0)
            indexed = await r.zcard(keys.EXPIRY)
            await _wait_for(r, deadline_ms + 5)
            sched = Scheduler(q.store, env.settings, "bench-sweeper")
            limit_s = 30 if env.quick else 180
            redis_cpu_s, cpu_s = await _redis_cpu_s(r), time.process_time()
            t = time.perf_counter()
            calls = 0
            while await r.zcard(keys.EXPIRY) > 0 and time.perf_counter() - t < limit_s:
                calls += 1
                if how == "scheduler":
                    if not (await sched.tick()).expired:
                        await asyncio.sleep(0.02)
                else:
                    await sweep_due(q.store, await redis_now_ms(r), 100)
            elapsed = time.perf_counter() - t
            cpu_s = time.process_time() - cpu_s
            redis_cpu_s = await _redis_cpu_s(r) - redis_cpu_s
            left = await r.zcard(keys.EXPIRY)
        finally:
            await q.close()
            await r.aclose()
            await env.flush()
        expired = indexed - left
        rate = expired / elapsed if elapsed else 0.0
        per_task = max(expired, 1) / 1e6
        values = {"seconds": elapsed, "rate": rate, "expired": expired, "left": left,
                  "calls": calls, "n": count, "redis_cpu_us_per_task": redis_cpu_s / per_task,
                  "client_cpu_us_per_task": cpu_s / per_task}  # fmt: skip
        if how == "scheduler":
            out.append(Result(
                "expiration.sweep",
                figure="seconds", unit="s", values=values,
                target=f"{count:,} within 30 s" if not env.quick else "",
                met=(left == 0 and elapsed <= 30) if not env.quick else None,
                note=f"{expired:,} delayed tasks expired at once, swept by Scheduler.tick() in "
                f"a loop ({calls:,} ticks, {rate:,.0f} tasks/s{_pace()})"
                + (f"; {left:,} left after {limit_s} s" if left else ""),
            ))  # fmt: skip
        else:
            out.append(Result(
                "expiration.sweep_cost",
                figure="rate", unit="tasks/s", values=values,
                note=f"admin.sweep_due(batch of 100) back to back, {calls:,} calls: what "
                "the sweep costs when nothing paces it; per task "
                f"{values['redis_cpu_us_per_task']:.1f} us of Redis CPU, "
                f"{values['client_cpu_us_per_task']:.1f} us of this process's",
            ))  # fmt: skip
    return out


async def _redis_cpu_s(r: Redis) -> float:
    """CPU seconds the Redis server has used (user + system)."""
    info = await r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _pace() -> str:
    """The sweep's own pace."""
    return f"; the sweep paces itself at {SWEEP_RATE:,}/s"


async def _during_drain(env: Env, n: int) -> Result:
    """The latency load on one worker twice: just before the deadline (no sweep), then from the
    deadline while the worker's own scheduler sweeps the ``n`` tasks (at ``SWEEP_RATE`` the sweep
    outlasts the window). The difference is the sweep's own effect, whatever the worker's
    latency without it."""
    await env.flush()
    q = await env.queue()
    r = await env.redis()
    duration = 1.0 if env.quick else 10.0
    values: dict[str, Any]
    try:
        # The deadline leaves time for the worker's warm-up and the window without the sweep;
        # the quick run's smoke test shares two cores with the rest of make test, where a
        # worker can take a few seconds to start.
        deadline_ms = await _fill_expiring(env, q, r, n, extra_s=duration + (4 if env.quick else 8))
        worker = spawn_worker(env, concurrency=env.concurrency)
        await warm_worker(worker, q, r)
        if await redis_now_ms(r) + duration * 1000 + 500 > deadline_ms:
            raise RuntimeError("the fill and the warm-up left no time for the window without sweep")
        before = await paced_load(env, q, r, duration)
        await _wait_for(r, deadline_ms)
        sweep_done: list[float] = []

        async def swept() -> bool:
            return await r.zcard(keys.EXPIRY) == 0

        async def watch() -> None:
            if await wait_until(swept, 30 if env.quick else 180, interval_s=0.05):
                sweep_done.append((await redis_now_ms(r) - deadline_ms) / 1000)

        watcher = asyncio.create_task(watch())
        values = await paced_load(env, q, r, duration)
        await watcher
        values["sweep_s"] = sweep_done[0] if sweep_done else None
        values["expiring"] = n
        for name in ("p50_ms", "p95_ms", "p99_ms", "client_p99_ms"):
            if name in before:
                values[f"no_sweep_{name}"] = before[name]
        values["sweep_adds_p99_ms"] = values["p99_ms"] - before["p99_ms"]
    finally:
        env.stop_children()
        await q.close()
        await r.aclose()
        await env.flush()
    sweep_s = values["sweep_s"]
    return Result(
        "expiration.latency_during_sweep",
        figure="p99_ms",
        unit="ms p99",
        values=values,
        target="p99 <= 10 ms; sweep <= 30 s" if not env.quick else "",
        met=(values["p99_ms"] <= 10 and (sweep_s or 1e9) <= 30) if not env.quick else None,
        note=f"200 tasks/s for {duration:.0f} s from the deadline while {n:,} tasks expire: p50 "
        f"{values['p50_ms']:.0f} ms; the same load just before (no sweep): p50 "
        f"{values['no_sweep_p50_ms']:.0f} / p99 {values['no_sweep_p99_ms']:.0f} ms, so the sweep "
        f"adds {values['sweep_adds_p99_ms']:+.0f} ms at p99; the worker's own scheduler swept "
        "them "
        + (
            f"in {sweep_s:.1f} s after the deadline"
            + ("" if sweep_s >= duration else " (less than the window: part of it had no sweep)")
            if sweep_s is not None
            else "not within the wait"
        ),
    )


async def run(env: Env) -> list[Result]:
    n = env.n(100_000, 500)
    return [*await _sweep(env, n), await _during_drain(env, n)]
