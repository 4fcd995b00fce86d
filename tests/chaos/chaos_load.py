"""Load and its bookkeeping: task specs, the load generator (every submit recorded as
accepted, refused or unknown), and the waits on Redis that tell when the load is done.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from chaos_harness import TERMINAL, now_ns, settings_for
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import connect, keys
from dtq.errors import DtqError, RedisUnavailableError


@dataclass
class Spec:
    """One task to submit."""

    seq: int
    task_type: str
    payload: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class SubmitRecord:
    seq: int
    invoked_ns: int
    done_ns: int = 0
    outcome: str = ""  # accepted | refused | unknown
    task_id: str | None = None
    detail: str = ""


def work_specs(rng: random.Random, n: int, start_seq: int = 0, **extra: Any) -> list[Spec]:
    """``n`` ordinary tasks: each sleeps 5-50 ms."""
    return [
        Spec(
            start_seq + i,
            "chaos_work",
            {"seq": start_seq + i, "ms": rng.randint(5, 50), **extra},
        )
        for i in range(n)
    ]


class LoadGen:
    """Submits specs at ``rate`` per second (None: as fast as ``concurrency`` allows)."""

    def __init__(self, concurrency: int = 32) -> None:
        self.records: list[SubmitRecord] = []
        self.concurrency = concurrency

    async def _paced(
        self, specs: Sequence[Spec], rate: float | None, one: Callable[[Spec], Awaitable[None]]
    ) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        t0 = time.monotonic()
        tasks: list[asyncio.Task[None]] = []

        async def run(spec: Spec) -> None:
            try:
                await one(spec)
            finally:
                sem.release()

        for i, spec in enumerate(specs):
            if rate:
                delay = t0 + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            await sem.acquire()
            tasks.append(asyncio.create_task(run(spec)))
        await asyncio.gather(*tasks)

    async def via_sdk(
        self,
        url: str,
        specs: Sequence[Spec],
        rate: float | None,
        *,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """``settings``: the scenario's overrides of the harness's (``SETTINGS`` names)."""
        queue = await connect(settings=settings_for(url, **_lower(settings)))
        try:

            async def one(spec: Spec) -> None:
                rec = SubmitRecord(spec.seq, now_ns())
                self.records.append(rec)
                try:
                    task = await queue.submit(spec.task_type, spec.payload, **spec.options)
                except RedisUnavailableError as exc:
                    rec.outcome = "refused" if _refused(str(exc)) else "unknown"
                    rec.detail = str(exc)[:200]
                except DtqError as exc:
                    rec.outcome, rec.detail = "refused", exc.code
                else:
                    rec.outcome, rec.task_id = "accepted", task.task_id
                rec.done_ns = now_ns()

            await self._paced(specs, rate, one)
        finally:
            await queue.close()

    async def via_http(
        self,
        base: str,
        specs: Sequence[Spec],
        rate: float | None,
        *,
        timeout_s: float = 10,
        on_response: Callable[[httpx.Response], None] | None = None,
    ) -> None:
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits) as client:

            async def one(spec: Spec) -> None:
                rec = SubmitRecord(spec.seq, now_ns())
                self.records.append(rec)
                body = {"task_type": spec.task_type, "payload": spec.payload, **spec.options}
                try:
                    resp = await client.post("/api/v1/tasks", json=body)
                except httpx.ConnectError as exc:
                    rec.outcome, rec.detail = "refused", f"connect: {exc}"
                except httpx.TransportError as exc:  # sent (maybe): no answer
                    rec.outcome = "unknown"
                    rec.detail = (
                        f"{type(exc).__name__}: {exc} after {_since_s(rec.invoked_ns):.1f}s"
                    )
                else:
                    if on_response is not None:
                        on_response(resp)
                    if resp.status_code in (200, 202):
                        rec.outcome, rec.task_id = "accepted", resp.json()["task_id"]
                    else:
                        rec.outcome, rec.detail = "refused", f"HTTP {resp.status_code}"
                rec.done_ns = now_ns()

            await self._paced(specs, rate, one)

    def accepted(self) -> dict[str, SubmitRecord]:
        return {r.task_id: r for r in self.records if r.outcome == "accepted" and r.task_id}

    def counts(self) -> dict[str, int]:
        out = {"invoked": len(self.records), "accepted": 0, "refused": 0, "unknown": 0}
        for r in self.records:
            out[r.outcome] = out.get(r.outcome, 0) + 1
        return out


def _lower(settings: Mapping[str, str] | None) -> dict[str, str]:
    return {k.lower(): v for k, v in (settings or {}).items()}


def _since_s(t_ns: int) -> float:
    return (now_ns() - t_ns) / 1e9


def _refused(message: str) -> bool:
    """A connection that was never made, or a cluster that refused to run the command while
    a failover is under way: the command cannot have run."""
    return "Connection refused" in message or "Error 111" in message or "cluster is down" in message


async def pending_entries(
    r: Redis, consumer: str, queues: Sequence[str] = ("default",)
) -> list[tuple[str, str, str]]:
    """(stream, entry id, task id) of every entry pending (delivered, not acknowledged) for
    ``consumer``."""
    out: list[tuple[str, str, str]] = []
    for q in queues:
        for stream in keys.queue_streams(q):
            try:
                rows = await r.xpending_range(
                    stream, keys.CONSUMER_GROUP, "-", "+", 10_000, consumername=consumer
                )
            except ResponseError:  # no stream or no group yet
                continue
            for row in rows:
                entry_id = str(row["message_id"])
                found = await r.xrange(stream, entry_id, entry_id)
                if found:
                    out.append((stream, entry_id, found[0][1]["task_id"]))
    return out


async def wait_quiet(
    r: Redis, task_ids: Iterable[str], timeout_s: float, queues: Sequence[str] = ("default",)
) -> list[str]:
    """Wait until every task is terminal and nothing is left in a stream, the retry schedule
    or the claimed set; returns the ids still not terminal at the deadline."""
    todo = set(task_ids)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = sorted(todo)
        pipe = r.pipeline(transaction=False)
        for tid in ids:
            pipe.hget(keys.task(tid), "status")
        for tid, status in zip(ids, await pipe.execute(), strict=True):
            if status in TERMINAL:
                todo.discard(tid)
        if not todo and await _indexes_empty(r, queues):
            return []
        await asyncio.sleep(0.2)
    return sorted(todo)


async def _indexes_empty(r: Redis, queues: Sequence[str]) -> bool:
    pipe = r.pipeline(transaction=False)
    for q in queues:
        for stream in keys.queue_streams(q):
            pipe.xlen(stream)
    for scope in keys.scopes(queues):  # the one schedule, or each queue's on a cluster
        pipe.zcard(keys.retry_schedule(scope))
        pipe.zcard(keys.retry_claimed(scope))
    return not any(await pipe.execute())


async def all_task_ids(r: Redis) -> list[str]:
    """Every task hash in Redis (SCAN; on a Redis Cluster, of every primary), whoever
    submitted it."""
    out = []
    async for key in r.scan_iter(match=keys.task_match(), count=1000):
        task_id = keys.task_id_of(key)
        if keys.task(task_id) == key:  # not a task's :history
            out.append(task_id)
    return out
