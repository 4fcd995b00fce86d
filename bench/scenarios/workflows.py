"""Workflows: a fan-out/fan-in DAG against plain tasks (docs/workflows.md).

``workflows.fan_in``: one root node, FAN (quick: FAN_QUICK) no-op members after it and one
callback after every member, submitted with ``Queue.submit_workflow`` while no worker runs, then
drained by one worker process (--concurrency WORKER_SLOTS) until the workflow has ended, all
SUCCEEDED. Reported: the submit's wall time, the end-to-end time from the workflow's creation
to its end (Redis clock), nodes/s over it, and Redis CPU per node (``INFO cpu`` over the
drain: the node's own submit, start and finish, the outbox entry and its relay, the
workflow.lua steps). Ratio: nodes/s against a drain of as many plain no-op tasks in the same run
(queued with ``submit_many`` first, so it measures the drain alone; the workflow's nodes are
queued as they are released).
"""

from __future__ import annotations

import time
from typing import Any

from bench.harness import NOOP_TASK, Env, Result, redis_now_ms, statuses, wait_until
from bench.workers import spawn_worker
from dtq import chord, group, node
from dtq.models import TaskStatus

__all__ = ["run"]

FAN, FAN_QUICK = 1_000, 50
WORKER_SLOTS = 64


async def _redis_cpu_s(env: Env) -> float:
    r = await env.redis()
    try:
        info = await r.info("cpu")
    finally:
        await r.aclose()
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def _plain(env: Env, n: int) -> float:
    """nodes/s of ``n`` plain no-op tasks, from the worker's spawn to the last completion."""
    await env.flush()
    q = await env.queue()
    try:
        ids = await env.fill(q, n, NOOP_TASK)
    finally:
        await q.close()
    r = await env.redis()
    try:
        spawn_ms = await redis_now_ms(r)
        worker = spawn_worker(env, concurrency=WORKER_SLOTS)

        async def done() -> bool:
            if not worker.alive():
                raise RuntimeError(f"the worker exited: {worker.tail()}")
            rows = await statuses(r, ids, "status")
            return all(st == TaskStatus.SUCCEEDED.value for (st,) in rows)

        if not await wait_until(done, 120, interval_s=0.1):
            raise RuntimeError("the plain tasks did not all succeed")
        end_ms = await redis_now_ms(r)
        worker.stop()
    finally:
        await r.aclose()
    return n / ((end_ms - spawn_ms) / 1000)


async def _fan_in(env: Env) -> Result:
    fan = env.n(FAN, FAN_QUICK)
    nodes = fan + 2
    plain_rate = await _plain(env, nodes)
    await env.flush()
    shape = chord(
        group(*(node(f"m{i}", NOOP_TASK, {"i": i}) for i in range(fan))), node("sink", NOOP_TASK)
    )
    shape = chord(node("root", NOOP_TASK), shape)
    q = await env.queue()
    try:
        t0 = time.perf_counter()
        wf = await q.submit_workflow(shape)
        submit_s = time.perf_counter() - t0
        cpu0 = await _redis_cpu_s(env)
        worker = spawn_worker(env, concurrency=WORKER_SLOTS)
        ended: dict[str, Any] = {}

        async def done() -> bool:
            if not worker.alive():
                raise RuntimeError(f"the worker exited: {worker.tail()}")
            got = await q.get_workflow(wf.workflow_id)
            ended["wf"] = got
            return got.status != "running"

        if not await wait_until(done, 300, interval_s=0.1):
            raise RuntimeError("the workflow did not end")
        cpu1 = await _redis_cpu_s(env)
        worker.stop()
    finally:
        await q.close()
    got = ended["wf"]
    if got.status != "succeeded" or got.finished_at is None:
        raise RuntimeError(f"the workflow ended {got.status}")
    e2e_s = (got.finished_at - got.created_at).total_seconds()
    rate = nodes / e2e_s
    return Result(
        "workflows.fan_in",
        figure="nodes_per_s",
        unit="nodes/s",
        values={
            "nodes_per_s": rate,
            "nodes": nodes,
            "submit_ms": submit_s * 1000,
            "end_to_end_s": e2e_s,
            "redis_cpu_us_per_node": (cpu1 - cpu0) / nodes * 1e6,
            "plain_tasks_per_s": plain_rate,
        },
        ratios={"plain": rate / plain_rate},
        note=f"root -> {fan:,} members -> callback, 1 process, --concurrency {WORKER_SLOTS}; "
        "end to end from the workflow's creation (includes the worker's start) against as "
        "many plain no-op tasks from the worker's spawn, same run",
    )


async def run(env: Env) -> list[Result]:
    try:
        return [await _fan_in(env)]
    finally:
        env.stop_children()
        await env.flush()
