"""Waits: how soon a waiting producer has a task's result, and what 1,000 waiters cost Redis.

``waits.result_latency``: one worker process; tasks submitted at RATE/s, each followed by a
``q.result()`` running concurrently (a producer that submits and waits). The latency of one
result is the wall-clock time the waiter had it minus the task's ``finished_at`` (the Redis
clock of the finish script, to the millisecond; Redis and this process read the same host
clock): p50, p99 and max. Target: p99 within 50 ms of the terminal state.

``waits.thousand_waiters``: 1,000 tasks submitted with nobody serving their queue, 1,000
concurrent ``q.result()`` calls started, then a worker drains them. Reported: blocked Redis
clients while they wait, XREAD and EVALSHA calls and the client's connections for the whole
wait (INFO commandstats / clients), and the time from the last task's end to the last result.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.harness import NOOP_TASK, PAYLOAD_100B, Env, Result, iso_ms, percentile, statuses
from bench.scenarios.latency import warm_worker
from bench.workers import spawn_worker

__all__ = ["run"]

RATE = 100
TARGET_P99_MS = 50
WAITERS = 1000


async def _result_latency(env: Env) -> Result:
    duration = 1.0 if env.quick else 5.0
    q = await env.queue()
    r = await env.redis()
    try:
        worker = spawn_worker(env, concurrency=env.concurrency)
        await warm_worker(worker, q, r)
        got: dict[str, float] = {}

        async def produce(i: int) -> None:
            task = await q.submit(NOOP_TASK, PAYLOAD_100B)
            await q.result(task.task_id, timeout=60)
            got[task.task_id] = time.time() * 1000

        n = int(RATE * duration)
        t0 = time.perf_counter()
        producers = []
        for i in range(n):
            delay = t0 + i / RATE - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            producers.append(asyncio.create_task(produce(i)))
        await asyncio.gather(*producers)
        ids = list(got)
        rows = await statuses(r, ids, "finished_at")
        lat = [got[tid] - iso_ms(fin) for tid, (fin,) in zip(ids, rows, strict=True) if fin]
    finally:
        env.stop_children()
        await q.close()
        await r.aclose()
    values: dict[str, Any] = {
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat),
        "n": len(lat),
    }
    return Result(
        "waits.result_latency",
        figure="p99_ms",
        unit="ms p99",
        values=values,
        target=f"p99 <= {TARGET_P99_MS} ms after the terminal state",
        met=values["p99_ms"] <= TARGET_P99_MS,
        note=f"{RATE}/s submit-then-result producers for {duration:.0f} s, one worker; "
        f"p50 {values['p50_ms']:.1f} ms, max {values['max_ms']:.1f} ms (finished_at has 1 ms "
        "resolution)",
    )


async def _thousand_waiters(env: Env) -> Result:
    n = 100 if env.quick else WAITERS
    q = await env.queue()
    r = await env.redis()
    try:
        items = [{"task_type": NOOP_TASK, "payload": PAYLOAD_100B, "queue": "waited"}] * n
        tasks = [t for t in await q.submit_many(items) if not isinstance(t, Exception)]
        await r.config_resetstat()
        waiters = [asyncio.create_task(q.result(t.task_id, timeout=120)) for t in tasks]
        blocked = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            blocked = int((await r.info("clients"))["blocked_clients"])
            if blocked:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # every waiter has joined a read
        info = await r.info("clients")
        blocked, clients = int(info["blocked_clients"]), int(info["connected_clients"])
        spawn_worker(env, concurrency=env.concurrency, queues=["waited"])
        await asyncio.gather(*waiters)
        last_result = time.time() * 1000
        stats = await r.info("commandstats")
        rows = await statuses(r, [t.task_id for t in tasks], "finished_at")
        last_end = max(iso_ms(fin) for (fin,) in rows if fin)
    finally:
        env.stop_children()
        await q.close()
        await r.aclose()
    xread = int(stats.get("cmdstat_xread", {}).get("calls", 0))
    values: dict[str, Any] = {
        "waiters": n,
        "blocked_clients": blocked,
        "connected_clients": clients,
        "xread_calls": xread,
        "xread_per_waiter": xread / n,
        "last_end_to_last_result_ms": last_result - last_end,
    }
    return Result(
        "waits.thousand_waiters",
        figure="xread_per_waiter",
        unit="XREAD per waiter",
        values=values,
        target="no per-waiter polling (< 1 read per waiter)",
        met=xread < n,
        note=f"{n} concurrent q.result() on one Queue: {blocked} blocked read(s), {clients} "
        f"client connection(s) in all while waiting, {xread} XREAD for the whole drain",
    )


async def run(env: Env) -> list[Result]:
    await env.flush()
    try:
        return [await _result_latency(env), await _thousand_waiters(env)]
    finally:
        await env.flush()
