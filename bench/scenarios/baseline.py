"""Raw redis-py asyncio Streams in one process: the ceiling every dtq figure is compared with.

Same client library, same ``decode_responses=True`` and same 100-byte payload as dtq, no dtq
code: pipelined XADD; XREADGROUP COUNT 32 + XACK; and the same with one HSET per message
(pipelined with its XACK), which is the least a queue that keeps a task record must do.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from bench.harness import PAYLOAD_100B, Env, Result
from dtq.models import compact_json

STREAM = "bench:stream"
GROUP = "g"
PIPE = 100
COUNT = 32


async def _fill(r: Redis, n: int) -> float:
    payload = compact_json(PAYLOAD_100B)
    await r.delete(STREAM)
    await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    t = time.perf_counter()
    for i in range(0, n, PIPE):
        pipe = r.pipeline(transaction=False)
        for j in range(i, min(n, i + PIPE)):
            pipe.xadd(STREAM, {"task_id": f"t{j}", "payload": payload})
        await pipe.execute()
    return n / (time.perf_counter() - t)


async def _consume(r: Redis, n: int, *, hset: bool) -> float:
    done = 0
    t = time.perf_counter()
    while done < n:
        reply = await r.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=COUNT)
        if not reply:
            break
        entries = reply[0][1]
        ids = [eid for eid, _ in entries]
        if hset:
            pipe = r.pipeline(transaction=False)
            for eid, fields in entries:
                pipe.hset(f"bench:h:{fields['task_id']}", mapping={"status": "done", "e": eid})
            pipe.xack(STREAM, GROUP, *ids)
            await pipe.execute()
        else:
            await r.xack(STREAM, GROUP, *ids)
        done += len(ids)
    return done / (time.perf_counter() - t)


async def measure(env: Env, n: int) -> dict[str, float]:
    """The three loops on ``n`` entries each; the figures also become ``env.baseline``, which
    the next scenarios' ratios use. The bench keys are deleted afterwards; dtq's are untouched.
    """
    r = await env.redis()
    try:
        xadd = await _fill(r, n)
        ack = await _consume(r, n, hset=False)
        await _fill(r, n)
        ack_hset = await _consume(r, n, hset=True)
        await r.delete(STREAM, *[f"bench:h:t{i}" for i in range(n)])
    finally:
        await r.aclose()
    figures = {"xadd": xadd, "consume_ack": ack, "consume_ack_hset": ack_hset}
    env.baseline.update(figures)
    return figures


async def refresh(env: Env) -> str:
    """Measure the baseline again just before a scenario, so its ratios compare figures taken
    under the same load (a shared machine's load drifts within a run); returns a note."""
    n = env.n(10_000, 1_000)
    b = await measure(env, n)
    return (
        f"ratios to a baseline taken just before: xadd {b['xadd']:,.0f}/s, consume+ack "
        f"{b['consume_ack']:,.0f}/s, +hset {b['consume_ack_hset']:,.0f}/s"
    )


async def run(env: Env) -> list[Result]:
    n = env.n(20_000, 2_000)
    await env.flush()
    b = await measure(env, n)
    await env.flush()
    xadd, ack, ack_hset = b["xadd"], b["consume_ack"], b["consume_ack_hset"]
    note = f"{n:,} entries, one asyncio process, redis-py + hiredis"
    return [
        Result("baseline.xadd_pipelined", figure="rate", unit="/s", values={"rate": xadd, "n": n},
               note=f"pipelines of {PIPE}; {note}"),
        Result("baseline.xreadgroup_xack", figure="rate", unit="/s", values={"rate": ack, "n": n},
               note=f"COUNT {COUNT}; {note}"),
        Result("baseline.xreadgroup_hset_xack", figure="rate", unit="/s",
               values={"rate": ack_hset, "n": n}, note=f"COUNT {COUNT}, HSETs + XACK pipelined"),
    ]  # fmt: skip
