"""Latency: 200 tasks/s for 10 s with a worker running; submit->start p50/p95/p99.

The figure the issue asks for is ``started_at - created_at`` of each task hash, both on the Redis
clock but only to the millisecond (so a 0.4 ms latency may read 0 or 1 ms). Beside it, the
client-observed latency, from just before ``submit`` to the TASK_STARTED event arriving on
``dtq:events`` (local monotonic clock, microseconds): an upper bound that adds the submit round
trip and the pub/sub delivery.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from redis.asyncio import Redis

from bench.harness import (
    NOOP_TASK,
    PAYLOAD_100B,
    Env,
    Managed,
    Result,
    iso_ms,
    percentile,
    statuses,
    wait_until,
)
from bench.workers import spawn_worker
from dtq import Queue, keys
from dtq.models import TaskStatus

RATE = 200


async def warm_worker(worker: Managed, q: Queue, r: Redis, timeout_s: float = 60) -> None:
    """Submit one task and wait for it to succeed: the worker is up and polling. A worker that
    exits instead is an error at once, with the end of its output."""
    task = await q.submit(NOOP_TASK, PAYLOAD_100B)

    async def done() -> bool:
        if not worker.alive():
            return True
        return await r.hget(keys.task(task.task_id), "status") == TaskStatus.SUCCEEDED.value

    if not await wait_until(done, timeout_s, interval_s=0.05):
        raise RuntimeError(f"the worker did not run a task within {timeout_s:.0f} s")
    if not worker.alive():
        raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.tail()}")


async def paced_load(env: Env, q: Queue, r: Redis, duration_s: float) -> dict[str, Any]:
    """Submit RATE tasks/s for ``duration_s``; wait for all; the latency percentiles in ms."""
    started_local: dict[str, float] = {}
    sent_local: dict[str, float] = {}
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.EVENTS)

    async def listen() -> None:
        async for msg in pubsub.listen():
            if msg["type"] != "message" or "TASK_STARTED" not in msg["data"]:
                continue
            now = time.perf_counter()
            ev = json.loads(msg["data"])
            if ev.get("type") == "TASK_STARTED":
                started_local.setdefault(ev["task_id"], now)

    listener = asyncio.create_task(listen())
    n = int(RATE * duration_s)
    ids: list[str] = []
    behind = 0.0
    t0 = time.perf_counter()
    for i in range(n):
        delay = t0 + i / RATE - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            behind = max(behind, -delay)
        sent = time.perf_counter()
        task = await q.submit(NOOP_TASK, PAYLOAD_100B)
        sent_local[task.task_id] = sent
        ids.append(task.task_id)
    achieved = n / (time.perf_counter() - t0)

    rows: list[list[str | None]] = []

    async def all_done() -> bool:
        nonlocal rows
        rows = await statuses(r, ids, "status", "created_ms", "started_at")
        return all(st == TaskStatus.SUCCEEDED.value for st, _, _ in rows)

    await wait_until(all_done, 60, interval_s=0.2)
    await asyncio.sleep(0.2)
    listener.cancel()
    await pubsub.unsubscribe()
    await pubsub.aclose()
    lat = [iso_ms(sa) - int(cm) for st, cm, sa in rows if st == "succeeded" and cm and sa]
    if len(lat) != n:
        raise RuntimeError(f"{n - len(lat)} of {n} tasks did not succeed within 60 s")
    seen = [(started_local[t] - sent_local[t]) * 1000 for t in ids if t in started_local]
    out: dict[str, Any] = {
        "p50_ms": percentile(lat, 50),
        "p95_ms": percentile(lat, 95),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat),
        "n": n,
        "achieved_rate": achieved,
        "max_behind_ms": behind * 1000,
    }
    if seen:
        out["client_p50_ms"] = percentile(seen, 50)
        out["client_p95_ms"] = percentile(seen, 95)
        out["client_p99_ms"] = percentile(seen, 99)
    return out


async def run(env: Env) -> list[Result]:
    await env.flush()
    duration = 1.0 if env.quick else 10.0
    q = await env.queue()
    r = await env.redis()
    try:
        worker = spawn_worker(env, concurrency=env.concurrency)
        await warm_worker(worker, q, r)
        values = await paced_load(env, q, r, duration)
    finally:
        env.stop_children()
        await q.close()
        await r.aclose()
        await env.flush()
    return [
        Result(
            "latency.submit_to_start",
            figure="p50_ms",
            unit="ms p50",
            values=values,
            target="p50 <= 1 ms, p99 <= 2 ms",
            met=values["p50_ms"] <= 1 and values["p99_ms"] <= 2,
            note=f"{RATE}/s for {duration:.0f} s, one worker (--concurrency {env.concurrency}); "
            f"p99 {values['p99_ms']:.0f} ms (Redis clock, 1 ms resolution); client-observed "
            f"p50/p99 {values.get('client_p50_ms', float('nan')):.2f}/"
            f"{values.get('client_p99_ms', float('nan')):.2f} ms",
        )
    ]
