"""Memory: Redis ``used_memory`` per queued task and per retained completed task (default
retention), with a 100-byte payload, on a server with Redis's default encoding settings.

Per task = (used_memory after - before) / N. Beside it, MEMORY USAGE of one task's keys and the
hash's encoding: the payload is a field of the hash (contract section 2), and a 100-byte value
takes the hash out of Redis's compact encoding (docs/performance.md has the figures).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from bench.harness import NOOP_TASK, Env, Result
from bench.workers import drain
from dtq import keys


async def _used(r: Redis) -> int:
    return int((await r.info("memory"))["used_memory"])


async def _sample(r: Redis, task_id: str) -> dict[str, Any]:
    out: dict[str, Any] = {"hash_encoding": await r.object("encoding", keys.task(task_id))}
    for name, key in (
        ("hash_bytes", keys.task(task_id)),
        ("history_bytes", keys.history(task_id)),
        ("result_bytes", keys.result(task_id)),
    ):
        out[name] = await r.memory_usage(key) or 0
    out["hash_fields"] = await r.hlen(keys.task(task_id))
    return out


async def run(env: Env) -> list[Result]:
    n = env.n(10_000, 300)
    await env.flush()
    r = await env.redis()
    q = await env.queue()
    out: list[Result] = []
    try:
        await q.submit(NOOP_TASK, {})  # streams, groups and the queue set exist before "before"
        before = await _used(r)
        ids = await env.fill(q, n, NOOP_TASK)
        queued = (await _used(r) - before) / n
        sample = await _sample(r, ids[0])
        cfg = await r.config_get("hash-max-*")
        out.append(
            Result(
                "memory.queued_task",
                figure="bytes",
                unit="B/task",
                values={"bytes": queued, "n": n, **sample},
                note=f"used_memory delta / {n:,}; hash {sample['hash_encoding']}, "
                f"{sample['hash_bytes']} B; {cfg}",
            )
        )
        await drain(env, ids, concurrency=env.concurrency)
        done = (await _used(r) - before) / n
        sample = await _sample(r, ids[0])
        out.append(
            Result(
                "memory.completed_task",
                figure="bytes",
                unit="B/task",
                values={"bytes": done, "n": n, **sample},
                note=f"SUCCEEDED, retained {env.settings.task_retention_s} s; hash (payload "
                f"included) {sample['hash_encoding']} {sample['hash_bytes']} B, history "
                f"{sample['history_bytes']} B, result {sample['result_bytes']} B",
            )
        )
    finally:
        await q.close()
        await r.aclose()
        await env.flush()
    return out
