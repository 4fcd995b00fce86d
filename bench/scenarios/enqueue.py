"""Enqueue through the SDK: one awaited submit at a time, 32 concurrent submits, submit_many in
batches of 100 and 1,000. Every figure is also a ratio to the raw pipelined XADD, measured again
just before (``baseline.refresh``).
(HTTP enqueue is :mod:`bench.scenarios.http`.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.harness import NOOP_TASK, PAYLOAD_100B, REFERENCE, Env, Result
from bench.scenarios import baseline
from dtq import Queue

CONCURRENT = 32


async def _single(q: Queue, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        await q.submit(NOOP_TASK, PAYLOAD_100B)
    return n / (time.perf_counter() - t)


async def _concurrent(q: Queue, n: int) -> float:
    per = n // CONCURRENT

    async def one() -> None:
        for _ in range(per):
            await q.submit(NOOP_TASK, PAYLOAD_100B)

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(CONCURRENT)))
    return per * CONCURRENT / (time.perf_counter() - t)


async def _many(q: Queue, n: int, batch: int) -> float:
    items = [{"task_type": NOOP_TASK, "payload": PAYLOAD_100B}] * batch
    done = 0
    t = time.perf_counter()
    while done < n:
        await q.submit_many(items)
        done += batch
    return done / (time.perf_counter() - t)


def _target(env: Env, rate: float, goal: float | None) -> dict[str, Any]:
    """An absolute target, judged as a ratio to this run's pipelined XADD (the target
    over the reference machine's 120k/s), so a slower or busier machine is judged fairly."""
    if goal is None:
        return {}
    share = goal / REFERENCE["xadd"]
    xadd = env.baseline.get("xadd")
    if not xadd:
        return {"target": f">= {goal:,}/s", "met": rate >= goal}
    return {
        "target": f">= {goal:,}/s on the reference machine = {share:.1%} of xadd",
        "met": rate / xadd >= share,
    }


def _ratios(env: Env, rate: float) -> dict[str, float]:
    xadd = env.baseline.get("xadd")
    return {"xadd": rate / xadd} if xadd else {}


async def run(env: Env) -> list[Result]:
    out: list[Result] = []
    cases = [
        ("enqueue.submit_single", lambda q: _single(q, env.n(5_000, 200)),
         5_000, "one awaited submit at a time"),
        ("enqueue.submit_concurrent32", lambda q: _concurrent(q, env.n(10_000, 320)),
         15_000, f"{CONCURRENT} concurrent submit loops, one process"),
        ("enqueue.submit_many_100", lambda q: _many(q, env.n(20_000, 500), 100),
         25_000, "submit_many, batches of 100"),
        ("enqueue.submit_many_1000", lambda q: _many(q, env.n(20_000, 1_000), 1_000),
         None, "submit_many, batches of 1,000"),
    ]  # fmt: skip
    await env.flush()
    await baseline.refresh(env)
    for name, fn, goal, note in cases:
        await env.flush()
        q = await env.queue()
        try:
            await q.submit(NOOP_TASK, PAYLOAD_100B)  # scripts loaded, connection open
            rate = await fn(q)
        finally:
            await q.close()
        if name == "enqueue.submit_many_1000":
            env.enqueue_rate = rate
        out.append(
            Result(
                name,
                figure="rate",
                unit="tasks/s",
                values={"rate": rate, "baseline_xadd": env.baseline.get("xadd", 0.0)},
                ratios=_ratios(env, rate),
                note=f"{note}; 100-byte payload",
                **_target(env, rate, goal),
            )
        )
    await env.flush()
    return out
