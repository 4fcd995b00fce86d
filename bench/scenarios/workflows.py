"""Workflows: a fan-out/fan-in DAG against plain tasks (docs/workflows.md).

``workflows.fan_in``: one root node, FAN (quick: FAN_QUICK) no-op members after it and one
callback after every member, submitted with ``Queue.submit_workflow`` to one running worker
process (--concurrency WORKER_SLOTS; warmed up by a one-node workflow, so its relay reads the
queue's outbox) until the workflow has ended, all SUCCEEDED. Reported: the submit's wall time,
the end-to-end time from the workflow's creation to its end (Redis clock), nodes/s over it,
and Redis CPU per node (``INFO cpu`` over the submit and the run: the node's own submit, start
and finish, the outbox entry and its relay, the workflow.lua steps, the harness's polling of
one field). Ratio: nodes/s against as many plain no-op tasks submitted at once
(``submit_many``) to a running worker, from the submit to the last completion, same run.
"""

from __future__ import annotations

import time

from bench.harness import (
    NOOP_TASK,
    Env,
    Managed,
    Result,
    iso_ms,
    redis_now_ms,
    statuses,
    wait_until,
)
from bench.workers import spawn_worker
from dtq import Queue, chord, group, keys, node
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


async def _warm(env: Env, q: Queue, worker: Managed) -> None:
    """A one-node workflow through the worker: it is up, and its relay reads the outbox."""
    wf = await q.submit_workflow(node("warm", NOOP_TASK))
    r = await env.redis()
    try:

        async def done() -> bool:
            if not worker.alive():
                raise RuntimeError(f"the worker exited: {worker.tail()}")
            return await r.hget(keys.workflow(wf.workflow_id), "status") == "succeeded"

        if not await wait_until(done, 60, interval_s=0.05):
            raise RuntimeError("the worker did not start")
    finally:
        await r.aclose()


async def _plain(env: Env, n: int) -> float:
    """Tasks/s of ``n`` plain no-op tasks submitted at once to a running worker, from the
    submit to the last completion (Redis clock)."""
    await env.flush()
    q = await env.queue()
    worker = spawn_worker(env, concurrency=WORKER_SLOTS)
    r = await env.redis()
    try:
        await _warm(env, q, worker)
        t0_ms = await redis_now_ms(r)
        ids = await env.fill(q, n, NOOP_TASK)

        async def done() -> bool:
            rows = await statuses(r, ids, "status")
            return all(st == TaskStatus.SUCCEEDED.value for (st,) in rows)

        if not await wait_until(done, 120, interval_s=0.05):
            raise RuntimeError("the plain tasks did not all succeed")
        ends = [iso_ms(fin) for (fin,) in await statuses(r, ids, "finished_at") if fin]
        worker.stop()
    finally:
        await r.aclose()
        await q.close()
    return n / ((max(ends) - t0_ms) / 1000)


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
    worker = spawn_worker(env, concurrency=WORKER_SLOTS)
    try:
        await _warm(env, q, worker)
        cpu0 = await _redis_cpu_s(env)
        t0 = time.perf_counter()
        wf = await q.submit_workflow(shape)
        submit_s = time.perf_counter() - t0

        async def done() -> bool:
            if not worker.alive():
                raise RuntimeError(f"the worker exited: {worker.tail()}")
            return await q.redis.hget(keys.workflow(wf.workflow_id), "status") != "running"

        if not await wait_until(done, 300, interval_s=0.05):
            raise RuntimeError("the workflow did not end")
        cpu1 = await _redis_cpu_s(env)
        worker.stop()
        got = await q.get_workflow(wf.workflow_id)
    finally:
        await q.close()
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
        note=f"root -> {fan:,} members -> callback, 1 running worker process, --concurrency "
        f"{WORKER_SLOTS}: end to end from the workflow's creation to its end, against as many "
        "plain no-op tasks from their submit to the last completion, same run; Redis CPU over "
        "the submit and the run (INFO cpu)",
    )


async def run(env: Env) -> list[Result]:
    try:
        return [await _fan_in(env)]
    finally:
        env.stop_children()
        await env.flush()
