"""Limits: how close a limited queue drains to its limit (docs/limits.md).

``limits.rate``: RATE_FULL/s (quick: RATE_QUICK/s) on the queue's no-op tasks, twenty seconds
of them (quick: two) queued at once, then one worker process until all are SUCCEEDED. Reported:
tasks/s from the first completion to the last (``finished_at``, Redis clock) and its ratio to
the limit. Target: within 10 % of it (the last task can start up to one scheduler pass after its
slot, so a short run reads low: the quick run's two seconds by up to a quarter).

``limits.concurrency``: a concurrency of CONCURRENCY on tasks that sleep SLEEP_MS each, drained
by one worker process with more slots than that. The ceiling is CONCURRENCY / SLEEP_MS (every
place busy all the time); reported: tasks/s as above and its ratio to the ceiling (no target:
a freed place's next task is made due by the finish and promoted by the scheduler's next
pass, so the figure shows what that hand-over costs). ``limits.concurrency_fast_scheduler`` is
the same with the worker's ``DTQ_SCHEDULER_INTERVAL_S`` at FAST_SCHEDULER_S instead of its
default, to show how the figure follows that interval.

``limits.fair``: the cost of fairness across keys. FAIR_TENANTS tenants' no-op tasks (the
payload's ``tenant``), drained by one worker process twice in one run: on a queue without a
limit, then with a keyed limit loose enough never to throttle (so its queue is served in turn
by tenant: held tasks, moves). Reported: the fair drain's tasks/s and its ratio to the plain
one (no target; docs/limits.md, "Fairness across keys").

The limits are written where the workers read them (``keys.limits(queue)``), as every surface
stores them; the fair one through the SDK, whose script also sets the queue's fairness path.
"""

from __future__ import annotations

import time
from typing import Any

from bench.harness import (
    NOOP_TASK,
    SLEEP_MS,
    SLEEP_TASK,
    Env,
    Result,
    iso_ms,
    redis_now_ms,
    statuses,
    wait_until,
)
from bench.workers import spawn_worker
from dtq import keys
from dtq.config import Settings
from dtq.limits import LimitDef
from dtq.models import TERMINAL, TaskStatus

__all__ = ["run"]

RATE_FULL, RATE_QUICK = 500, 100
CONCURRENCY = 8
TOLERANCE = 0.10  # the rate's target: within 10 % of the limit
WORKER_SLOTS = 64
DEFAULT_SCHEDULER_S = Settings.model_fields["scheduler_interval_s"].default
FAST_SCHEDULER_S = 0.05
ENDED = {s.value for s in TERMINAL}
FAIR_TENANTS = 100


async def _define(env: Env, name: str, limit: LimitDef) -> None:
    r = await env.redis()
    try:
        await r.hset(keys.limits(limit.queue), name, limit.to_json())
    finally:
        await r.aclose()


async def _drain(env: Env, ids: list[str], timeout_s: float, **worker_env: str) -> dict[str, Any]:
    """A worker process on the queued ``ids`` until every one ended (a parked task is out of
    its stream, so an empty stream is not the end), all SUCCEEDED: the completions' span and
    rate."""
    r = await env.redis()
    try:
        spawn_ms = await redis_now_ms(r)
        t = time.monotonic()
        worker = spawn_worker(env, concurrency=WORKER_SLOTS, **worker_env)
        rows: list[list[str | None]] = []

        async def all_done() -> bool:
            nonlocal rows
            if not worker.alive():
                raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.tail()}")
            rows = await statuses(r, ids, "status", "finished_at")
            return all(st in ENDED for st, _ in rows)

        if not await wait_until(all_done, timeout_s, interval_s=0.25):
            raise RuntimeError(f"not all of {len(ids)} tasks ended within {timeout_s:.0f} s")
        wall = time.monotonic() - t
        worker.stop()
    finally:
        await r.aclose()
    bad = {st for st, _ in rows if st != TaskStatus.SUCCEEDED.value}
    if bad:
        raise RuntimeError(f"not every task SUCCEEDED: {sorted(str(b) for b in bad)}")
    ends = sorted(iso_ms(fin) for _, fin in rows if fin)
    span_s = (ends[-1] - ends[0]) / 1000
    return {
        "rate": (len(ends) - 1) / span_s if span_s > 0 else float("nan"),
        "span_s": span_s,
        "from_spawn_s": (ends[-1] - spawn_ms) / 1000,
        "wall_s": wall,
        "n": len(ends),
    }


async def _rate(env: Env) -> Result:
    per_s = RATE_QUICK if env.quick else RATE_FULL
    n = per_s * (2 if env.quick else 20)
    await env.flush()
    await _define(env, "bench-rate", LimitDef(rate=f"{per_s}/s"))
    q = await env.queue()
    try:
        ids = await env.fill(q, n, NOOP_TASK)
    finally:
        await q.close()
    values = await _drain(env, ids, timeout_s=60 + 3 * n / per_s)
    ratio = values["rate"] / per_s
    values["limit_per_s"] = per_s
    return Result(
        "limits.rate",
        figure="rate",
        unit="tasks/s",
        values=values,
        ratios={"limit": ratio},
        target=f"within {TOLERANCE:.0%} of {per_s}/s",
        met=abs(ratio - 1) <= TOLERANCE,
        note=f"{n:,} no-op tasks queued at once under rate {per_s}/s (burst 1), 1 process, "
        f"--concurrency {WORKER_SLOTS}",
    )


async def _concurrency(env: Env, scheduler_interval_s: float) -> Result:
    n = env.n(1_000, 80) if scheduler_interval_s >= DEFAULT_SCHEDULER_S else env.n(4_000, 400)
    ceiling = CONCURRENCY * 1000 / SLEEP_MS
    await env.flush()
    await _define(env, "bench-concurrency", LimitDef(concurrency=CONCURRENCY))
    q = await env.queue()
    try:
        ids = await env.fill(q, n, SLEEP_TASK)
    finally:
        await q.close()
    values = await _drain(
        env,
        ids,
        timeout_s=120 + 2 * n / CONCURRENCY,
        DTQ_SCHEDULER_INTERVAL_S=str(scheduler_interval_s),
    )
    values["ceiling_per_s"] = ceiling
    values["scheduler_interval_s"] = scheduler_interval_s
    default = scheduler_interval_s == DEFAULT_SCHEDULER_S
    return Result(
        "limits.concurrency" if default else "limits.concurrency_fast_scheduler",
        figure="rate",
        unit="tasks/s",
        values=values,
        ratios={"ceiling": values["rate"] / ceiling},
        note=f"{n:,} tasks sleeping {SLEEP_MS} ms under concurrency {CONCURRENCY} "
        f"(ceiling {ceiling:.0f}/s), 1 process, --concurrency {WORKER_SLOTS}, "
        f"DTQ_SCHEDULER_INTERVAL_S {scheduler_interval_s}"
        + ("" if default else " (not the default)"),
    )


async def _fair(env: Env) -> Result:
    n = env.n(20_000, 2_000)
    drained: dict[str, dict[str, Any]] = {}
    for kind in ("plain", "fair"):
        await env.flush()
        q = await env.queue()
        try:
            if kind == "fair":
                await q.put_limit("bench-fair", key="payload.tenant", concurrency=1_000_000)
            ids: list[str] = []
            for start in range(0, n, 1000):
                items = [
                    {"task_type": NOOP_TASK, "payload": {"tenant": f"t{i % FAIR_TENANTS}"}}
                    for i in range(start, min(n, start + 1000))
                ]
                for t in await q.submit_many(items):
                    if isinstance(t, Exception):
                        raise t
                    ids.append(t.task_id)
        finally:
            await q.close()
        drained[kind] = await _drain(env, ids, timeout_s=120 + n / 100)
    values = drained["fair"]
    values["plain_rate"] = drained["plain"]["rate"]
    return Result(
        "limits.fair",
        figure="rate",
        unit="tasks/s",
        values=values,
        ratios={"plain": values["rate"] / drained["plain"]["rate"]},
        note=f"{n:,} no-op tasks of {FAIR_TENANTS} tenants, 1 process, --concurrency "
        f"{WORKER_SLOTS}: a keyed limit that never throttles against no limit, same run",
    )


async def run(env: Env) -> list[Result]:
    try:
        return [
            await _fair(env),
            await _rate(env),
            await _concurrency(env, DEFAULT_SCHEDULER_S),
            await _concurrency(env, FAST_SCHEDULER_S),
        ]
    finally:
        env.stop_children()
        await env.flush()
