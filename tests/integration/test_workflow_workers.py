"""A 500-wide chord over three worker processes, one of them SIGKILLed in the middle
(docs/workflows.md): every member's task runs to SUCCEEDED (one task per member: the releases a
dead relay left are absorbed), the callback runs exactly once and sees the 500 results. Counted
from the handlers' own log in Redis."""

from __future__ import annotations

import json
import signal
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from redis.asyncio import Redis

from dtq import Queue, chord, group, node
from support import wait_until
from support.worker import WorkerProcess, wait_worker_ready

pytestmark = [pytest.mark.backends("single"), pytest.mark.slow]

WIDTH = 500
CONCURRENCY = 16

TASKS = '''
"""A chord's member and callback, each start recorded in Redis."""
import asyncio
import json
import os

import redis.asyncio as redis

from dtq_tasks import task

_r = None


async def _log(what):
    global _r
    if _r is None:
        _r = redis.Redis.from_url(os.environ["DTQ_REDIS_URL"], decode_responses=True)
    await _r.rpush("test:wf:log", what)


@task("wf_member")
async def wf_member(payload, ctx):
    await _log("start:" + ctx.node)
    await asyncio.sleep(0.02)
    return payload["i"]


@task("wf_merge")
async def wf_merge(payload, ctx):
    await _log("start:" + ctx.node)
    merged = sorted(p.result for p in ctx.parent_results.values() if p.succeeded)
    await _r.set("test:wf:merged", json.dumps(merged))
    return len(merged)
'''


async def test_a_wide_chord_survives_a_sigkilled_worker(
    tmp_path: Path, redis_url: str, queue: Queue, r: Redis
) -> None:
    (tmp_path / "wf_tasks.py").write_text(textwrap.dedent(TASKS))
    procs = [
        WorkerProcess(
            redis_url,
            tmp_path,
            worker_id=f"worker-wf{i:05d}",
            tasks="wf_tasks",
            args=("--concurrency", str(CONCURRENCY)),
            env={"VISIBILITY_TIMEOUT_S": 3, "HEARTBEAT_INTERVAL_S": 1},
        )
        for i in range(3)
    ]
    try:
        for p in procs:
            await wait_worker_ready(r, p.worker_id or "")
        members = group(*(node(f"m{i}", "wf_member", {"i": i}) for i in range(WIDTH)))
        wf = await queue.submit_workflow(chord(members, node("merge", "wf_merge")))

        async def a_fifth_started() -> bool:
            return await r.llen("test:wf:log") >= WIDTH // 5

        await wait_until(a_fifth_started, 60, "a fifth of the members to start")
        procs[0].signal(signal.SIGKILL)
        procs[0].wait(10)

        async def ended() -> bool:
            return (await queue.get_workflow(wf.workflow_id)).status != "running"

        await wait_until(ended, 120, "the workflow to end")
        wf = await queue.get_workflow(wf.workflow_id)
    finally:
        for p in procs:
            p.stop()
    assert wf.status == "succeeded", [
        (n.name, n.status) for n in wf.nodes if n.status != "succeeded"
    ]
    assert {n.status for n in wf.nodes} == {"succeeded"}
    assert len({n.task_id for n in wf.nodes}) == WIDTH + 1
    starts = Counter(x.removeprefix("start:") for x in await r.lrange("test:wf:log", 0, -1))
    assert starts["merge"] == 1
    assert set(starts) == {*(f"m{i}" for i in range(WIDTH)), "merge"}
    # Only the members in flight on the killed worker ran twice.
    assert sum(starts.values()) <= WIDTH + 1 + CONCURRENCY
    assert json.loads(await r.get("test:wf:merged") or "[]") == list(range(WIDTH))
